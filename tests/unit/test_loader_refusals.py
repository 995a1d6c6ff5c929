"""The engine's checkpoint loader refuses what it would otherwise run wrongly (issue 10).

Corrupt or truncated safetensors, a config with fewer layers than its weights, and
integer / bool weights where floats are expected: each is an `EngineError` naming the
file or tensor, never a silent wrong answer or an internal error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hybridkv.demo import DEMO_DRAFT  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

WEIGHTS = "model.safetensors"


@pytest.fixture
def draft_copy(tmp_path: Path) -> Path:
    """A private copy of the demo draft (Qwen3, 2 layers) to damage."""
    folder = tmp_path / "draft"
    shutil.copytree(DEMO_DRAFT, folder)
    return folder


def test_the_intact_copy_loads(draft_copy: Path) -> None:
    model = load_model(draft_copy)
    assert len(model.layers) == 2


def test_truncated_weights_name_the_file(draft_copy: Path) -> None:
    path = draft_copy / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineError, match=r"cannot read weights file .*model\.safetensors"):
        load_model(draft_copy)


def test_garbage_weights_name_the_file(draft_copy: Path) -> None:
    (draft_copy / WEIGHTS).write_bytes(b"\x00" * 64)
    with pytest.raises(EngineError, match="truncated or not safetensors"):
        load_model(draft_copy)


def test_bad_index_is_refused(draft_copy: Path) -> None:
    (draft_copy / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(EngineError, match="not a safetensors index"):
        load_model(draft_copy)


def test_fewer_config_layers_than_weights_names_the_unused_tensors(draft_copy: Path) -> None:
    config_path = draft_copy / "config.json"
    config = json.loads(config_path.read_text())
    config["num_hidden_layers"] = 1
    config["layer_types"] = config["layer_types"][:1]
    config_path.write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"does not use: model\.layers\.1\."):
        load_model(draft_copy)


@pytest.mark.parametrize("dtype", ["int8", "bool"])
def test_integer_weights_are_refused(draft_copy: Path, dtype: str) -> None:
    path = draft_copy / WEIGHTS
    tensors = safetensors_torch.load_file(str(path))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(getattr(torch, dtype))
    safetensors_torch.save_file(tensors, str(path))
    with pytest.raises(EngineError, match=rf"{name}.*is torch\.{dtype}"):
        load_model(draft_copy)


# ------------------------------------------------------------------ thread choice


def test_small_models_run_on_one_thread_unless_asked(tmp_path: Path) -> None:
    from hybridkv.engine.threads import SMALL_MODEL_BYTES, choose_threads

    assert choose_threads(None, [DEMO_DRAFT]) == 1
    assert choose_threads(3, [DEMO_DRAFT]) == 3
    big = tmp_path / "big"
    big.mkdir()
    with open(big / WEIGHTS, "wb") as handle:  # sparse: no disk used
        handle.truncate(SMALL_MODEL_BYTES + 1)
    assert choose_threads(None, [big]) is None  # torch's default
    with pytest.raises(EngineError, match="--threads=0"):
        choose_threads(0, [DEMO_DRAFT])


def test_generate_takes_threads() -> None:
    from typer.testing import CliRunner

    import hybridkv.cli.engine  # noqa: F401  (registers generate)
    from hybridkv.cli import app

    runner = CliRunner()
    args = ["generate", "demo-draft", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    result = runner.invoke(app, [*args, "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["outputs"][0]["token_ids"]) == 2
    result = runner.invoke(app, [*args, "--threads", "0"])
    assert result.exit_code == 2
    assert "--threads=0 must be from 1" in " ".join(result.output.split())

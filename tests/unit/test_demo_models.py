"""The built-in demo models (``hybridkv/engine/models/demo_models``) and the byte tokenizer.

The checkpoints are produced by ``scripts/train_demo_models.py``: a byte-level Qwen3.5
hybrid main model (Gated DeltaNet + gated full attention) and a dense Qwen3 draft.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.engine.models.tokenizer import ByteTokenizer, load_tokenizer

DEMO = (
    Path(__file__).resolve().parents[2] / "src" / "hybridkv" / "engine" / "models" / "demo_models"
)
SIZE_LIMIT = 6_500_000  # bytes, both checkpoints together


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x + 1  # café ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    framed = tok.encode(text, add_bos=True, add_eos=True)
    assert framed[0] == tok.bos_token_id and framed[-1] == tok.eos_token_id
    assert tok.decode(framed) == text
    assert tok.decode(framed, skip_special_tokens=False) == f"<bos>{text}<eos>"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence decodes with U+FFFD
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} == {256, 257, 258}
    assert tok.vocab_size == len(tok) == 272


def test_load_tokenizer(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(DEMO / "main"), ByteTokenizer)
    assert isinstance(load_tokenizer(DEMO / "draft"), ByteTokenizer)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert load_tokenizer(tmp_path) is None
    assert load_tokenizer(tmp_path / "missing") is None


def test_metadata_and_sizes() -> None:
    meta = json.loads((DEMO / "metadata.json").read_text())
    assert meta["python"]["version"]
    files = meta["corpus"]["train_files"]
    assert files and all(len(f["sha256"]) == 64 for f in files)
    assert [f["path"] for f in files] == sorted(f["path"] for f in files)
    held = {f["path"] for f in meta["corpus"]["heldout_files"]}
    assert held and not held & {f["path"] for f in files}
    assert 0.0 <= meta["evaluation"]["greedy_agreement"] <= 1.0
    assert meta["evaluation"]["speculative_k4"]["mean_accepted_length"] >= 0.0
    total = 0
    for name in ("main", "draft"):
        config = json.loads((DEMO / name / "config.json").read_text())
        assert config["hybridkv_tokenizer"] == "bytes"
        assert config["vocab_size"] == ByteTokenizer.VOCAB_SIZE
        total += sum(p.stat().st_size for p in (DEMO / name).iterdir())
    assert total <= SIZE_LIMIT


def test_demo_configs_architectures() -> None:
    main = json.loads((DEMO / "main" / "config.json").read_text())
    draft = json.loads((DEMO / "draft" / "config.json").read_text())
    assert main["model_type"] == "qwen3_5_text"
    assert set(main["layer_types"]) == {"linear_attention", "full_attention"}
    assert draft["model_type"] == "qwen3"


@pytest.mark.parametrize("name", ["main", "draft"])
def test_demo_checkpoint_loads_with_transformers(name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(DEMO / name), dtype=torch.float32
    ).eval()
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode("import os\n\ndef main():\n    ", add_bos=True)])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, ids.shape[1], ByteTokenizer.VOCAB_SIZE)
    assert torch.isfinite(logits).all()

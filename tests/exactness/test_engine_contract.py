"""Engine contracts beyond greedy tokens: recompute from a dirty slot, logits at chosen
positions (speculative verification), and loader errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import (  # noqa: E402
    PagedCache,
    engine_greedy,
    hf_greedy,
    prompts_for,
    save_tiny,
)

from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

NUM_NEW = 12


def _qwen3_5_config(**overrides):
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )
    return transformers.Qwen3_5TextConfig(**(base | overrides))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_contract")
    hf = save_tiny(transformers.Qwen3_5ForCausalLM, _qwen3_5_config(), folder)
    return folder, hf, load_model(folder)


def test_recomputed_request_ignores_stale_slot_and_blocks(hybrid):
    """A request restarted from scratch (preemption by recompute) in slots and blocks that
    hold a previous run's state must produce the same tokens as a clean run."""
    _, hf, model = hybrid
    prompts = prompts_for(128)
    expected = hf_greedy(hf, prompts, NUM_NEW)
    max_len = max(len(p) for p in prompts) + NUM_NEW
    paged = PagedCache(model, len(prompts), max_len, block_size=4)
    first = engine_greedy(model, prompts, NUM_NEW, chunk_size=3, block_size=4, paged=paged)
    # Reversed prompts: every request now lands in another request's dirty slot and blocks.
    again = engine_greedy(model, prompts[::-1], NUM_NEW, chunk_size=5, block_size=4, paged=paged)
    assert first == expected
    assert again == expected[::-1]


def test_logits_at_several_positions_per_request_match_full_forward(hybrid):
    """Speculative verification scores several positions per request in one step."""
    _, hf, model = hybrid
    a = list(range(3, 20))
    b = list(range(40, 50))
    paged = PagedCache(model, 2, 32, block_size=4)
    # Step 1: request a prefills 12 tokens; request b prefills all of its 10.
    model.forward(paged.batch([0, 1], [(a[:12], 0), (b, 0)]), paged.caches)
    # Step 2: a scores its last 5 tokens ("drafts"); b is absent from this step.
    step = paged.batch([0], [(a[12:], 12)])
    step = dataclasses.replace(step, logits_indices=torch.arange(5))
    got = model.forward(step, paged.caches)
    with torch.no_grad():
        ref = hf(torch.tensor([a])).logits[0, 12:]
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1e-5)


def test_loader_rejects_tensor_shape_that_contradicts_config(tmp_path):
    folder = tmp_path / "ckpt"
    save_tiny(transformers.Qwen3_5ForCausalLM, _qwen3_5_config(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(128, 64\)"):
        load_model(folder)


def test_loader_rejects_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nope"}))
    with pytest.raises(EngineError, match="nope"):
        load_model(tmp_path)

"""Fused projections (`hybridkv.engine.models.fused`) change no bit.

The engine multiplies a layer's input once by stacked q/k/v, gate/up and Gated
DeltaNet qkv/z weights where every part is wide (>= 64 rows, a multiple of 64). Here:
the rule, each fused product against the separate ones with `torch.equal` (1 and 2
threads, 1 to 1216 rows), and a Qwen3.5 hybrid whose sizes fuse, token for token
against transformers through `LLM` (batched) and the harness (chunked prefill).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402
from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.engine.models.attention_block import Attention  # noqa: E402
from hybridkv.engine.models.common import GatedMLP, activation  # noqa: E402
from hybridkv.engine.models.fused import can_fuse, fuse  # noqa: E402

ROWS = (1, 3, 8, 32, 33, 257, 1216)
NUM_NEW = 24


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_rule_keeps_narrow_or_odd_parts_apart():
    assert can_fuse([1024, 128, 128])
    assert can_fuse([1280, 1280])
    assert not can_fuse([1024])  # nothing to fuse
    assert not can_fuse([1024, 8])  # a Gated DeltaNet b / a projection: one row per head
    assert not can_fuse([1000, 1000])  # silu's scalar tail per row would round otherwise
    assert not can_fuse([128, 32])


@pytest.mark.parametrize("sizes", [[1024, 128, 128], [1536, 512], [192, 64]])
def test_fused_products_equal_separate_ones(threads, sizes):
    torch.manual_seed(0)
    weights = [torch.randn(n, 96) * 0.05 for n in sizes]
    stacked, parts = fuse(weights)
    assert all(torch.equal(p, w) for p, w in zip(parts, weights, strict=True))
    assert parts[0].data_ptr() == stacked.data_ptr()  # views, not copies
    for rows in ROWS:
        x = torch.randn(rows, 96)
        fused = F.linear(x, stacked).split(sizes, dim=-1)
        for w, got in zip(weights, fused, strict=True):
            assert torch.equal(F.linear(x, w), got), (rows, w.shape)


@pytest.mark.parametrize("inter", [128, 1280, 100])
def test_gated_mlp_fused_equals_transformers_form(threads, inter):
    torch.manual_seed(1)
    gate, up = torch.randn(inter, 64) * 0.1, torch.randn(inter, 64) * 0.1
    down = torch.randn(64, inter) * 0.1
    mlp = GatedMLP(gate=gate.clone(), up=up.clone(), down=down, act=activation("silu"))
    assert (mlp.gate_up is not None) == (inter % 64 == 0)
    for rows in ROWS:
        x = torch.randn(rows, 64)
        # transformers' LlamaMLP-style form, out of place
        expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
        assert torch.equal(mlp(x), expected), rows


def test_attention_fuses_only_wide_parts():
    def weights(q_rows, kv_rows, bias):
        b = (lambda n: torch.zeros(n)) if bias else (lambda n: None)
        return dict(
            q_proj=torch.randn(q_rows, 64),
            k_proj=torch.randn(kv_rows, 64),
            v_proj=torch.randn(kv_rows, 64),
            q_bias=b(q_rows),
            k_bias=b(kv_rows),
            v_bias=b(kv_rows),
        )

    def build(**w):
        return Attention(
            shape=None, o_proj=torch.randn(64, 64), o_bias=None, q_norm=None, k_norm=None,
            rope=None, scale=1.0, **w,
        )  # fmt: skip

    wide = build(**weights(256, 128, bias=True))
    assert wide.qkv_proj is not None and wide.qkv_bias is not None
    assert wide.k_proj.data_ptr() == wide.qkv_proj[256:].data_ptr()
    assert build(**weights(128, 32, bias=False)).qkv_proj is None


@pytest.fixture(scope="module")
def fusable_qwen3_5(tmp_path_factory):
    # sizes where every projection fuses: q 4 x 64 x 2 (gated) = 512, k / v 128,
    # Gated DeltaNet qkv 2 x 32 x 2 + 4 x 16 = 192 and z 64, MLP 128 + 128
    config = transformers.Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2,
    )
    folder = tmp_path_factory.mktemp("qwen3_5_fused")
    hf = save_tiny(transformers.Qwen3_5ForCausalLM, config, folder)
    prompts = prompts_for(config.vocab_size)
    return folder, prompts, hf_greedy(hf, prompts, NUM_NEW)


def test_fusable_qwen3_5_fuses_every_projection(fusable_qwen3_5):
    folder, _, _ = fusable_qwen3_5
    model = load_model(folder)
    attention = [b.mixer for b in model.blocks if isinstance(b.mixer, Attention)]
    assert len(attention) == 2 and all(m.qkv_proj is not None for m in attention)
    assert all(b.mlp.gate_up is not None for b in model.blocks)
    deltanets = [b.mixer for b in model.blocks if not isinstance(b.mixer, Attention)]
    assert all(m.project.__name__ == "project_fused" for m in deltanets)  # qkv / z


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (5, 16), (None, 8)])
def test_fusable_qwen3_5_matches_transformers(fusable_qwen3_5, chunk_size, block_size):
    folder, prompts, expected = fusable_qwen3_5
    got = engine_greedy(
        load_model(folder), prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size
    )
    assert got == expected


def test_fusable_qwen3_5_batched_llm_matches_transformers(fusable_qwen3_5):
    folder, prompts, expected = fusable_qwen3_5
    llm = LLM(folder, max_num_batched_tokens=64)
    assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == expected

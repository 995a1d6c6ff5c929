"""Fast paths for bf16 models (docs/performance.md) against the paths they
replace: the decode update of bf16 ssm states through slot-run views, bit for bit
against the gather / scatter path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from hybridkv.engine.ops import state_batched  # noqa: E402
from hybridkv.engine.ops.context import StateCache  # noqa: E402
from hybridkv.engine.ops.state_batched import state_parts  # noqa: E402
from tests.engine.test_decode_fast_paths import slots_case  # noqa: E402


@pytest.mark.parametrize("slots", [[2, 4, 6, 8], [23, 247, 254, 261, 268], [9, 2, 4, 6, 30, 31]])
def test_bf16_state_slot_runs_equal_gather_path_bit_for_bit(monkeypatch, slots):
    """A bf16 ssm buffer (as a bf16 model keeps it): the slot-run views (float32 copy
    in, kernel, cast back through the view) give exactly the gather path's outputs and
    slots, and leave every other slot untouched."""
    layer, batch, x, conv, ssm = slots_case(len(slots), slots)
    ssm = ssm.to(torch.bfloat16)
    (part,) = state_parts(batch, "s")
    assert part.slot_runs is not None  # the path under test
    fast = StateCache(conv.clone(), ssm.clone(), "s")
    got = layer.forward(x, batch, fast, batched=True)
    monkeypatch.setattr(state_batched, "MAX_SLOT_RUNS", 0)  # every step gathers
    _, plain_batch, _, _, _ = slots_case(len(slots), slots)
    (plain_part,) = state_parts(plain_batch, "s")
    assert plain_part.slot_runs is None
    plain = StateCache(conv.clone(), ssm.clone(), "s")
    want = layer.forward(x, plain_batch, plain, batched=True)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(fast.ssm.float().nan_to_num(7.0), plain.ssm.float().nan_to_num(7.0))
    assert torch.equal(fast.conv.nan_to_num(7.0), plain.conv.nan_to_num(7.0))
    untouched = [s for s in range(ssm.shape[0]) if s not in slots]
    assert fast.ssm[untouched].isnan().all()
    assert not torch.equal(fast.ssm[slots].float(), ssm[slots].float())  # states moved


def _moe(gen: torch.Generator, *, shared_inter: int = 8, dtype=torch.float32):
    from hybridkv.engine.models.common import GatedMLP, activation
    from hybridkv.engine.models.qwen3_5 import SparseMoE

    experts, hidden, inter = 4, 16, 8

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype)

    return SparseMoE(
        router=w(experts, hidden),
        gate_up=w(experts, 2 * inter, hidden),
        down=w(experts, hidden, inter),
        top_k=2,
        norm_topk_prob=True,
        act_name="silu",
        shared=GatedMLP(
            w(shared_inter, hidden),
            w(shared_inter, hidden),
            w(hidden, shared_inter),
            activation("silu"),
        ),
        shared_gate=w(1, hidden),
    )


def _cast(moe, dtype):
    from dataclasses import replace

    from hybridkv.engine.models.common import GatedMLP

    shared = GatedMLP(
        moe.shared.gate.to(dtype),
        moe.shared.up.to(dtype),
        moe.shared.down.to(dtype),
        moe.shared.act,
    )
    return replace(
        moe,
        router=moe.router.to(dtype),
        gate_up=moe.gate_up.to(dtype),
        down=moe.down.to(dtype),
        shared=shared,
        shared_gate=moe.shared_gate.to(dtype),
    )


@pytest.mark.parametrize("num_tokens", [1, 5, 32])
def test_dense_moe_equals_the_dispatch_loop_in_float64(num_tokens):
    """The dense form (every expert, routing weights as column scales, one down product)
    computes the loop's sum: equal to float64 rounding."""
    from hybridkv.engine.models.moe import DenseMoE

    gen = torch.Generator().manual_seed(num_tokens)
    moe = _cast(_moe(gen), torch.float64)
    x = torch.randn(num_tokens, 16, generator=gen, dtype=torch.float64)
    dense = moe._dense_form()
    assert isinstance(dense, DenseMoE)
    want = moe(x)  # float64: the loop
    torch.testing.assert_close(dense(x), want, rtol=1e-12, atol=1e-12)


def test_float32_never_takes_the_dense_form():
    """float32 keeps the loop (its sums match transformers'): no dense weights built."""
    moe = _moe(torch.Generator().manual_seed(0))
    moe(torch.randn(4, 16))
    assert moe._dense is None


@pytest.mark.parametrize("num_tokens", [3, 200])
def test_bf16_moe_within_bf16_rounding_of_float64(num_tokens):
    """bf16: the dense form for short steps (<= DENSE_MAX_TOKENS), the loop for long
    ones; both within bf16 rounding of the float64 loop."""
    from hybridkv.engine.models.moe import DENSE_MAX_TOKENS

    gen = torch.Generator().manual_seed(7)
    moe64 = _cast(_moe(gen), torch.float64)
    moe16 = _cast(moe64, torch.bfloat16)
    x = torch.randn(num_tokens, 16, generator=gen).to(torch.bfloat16)
    got = moe16(x)
    assert (moe16._dense is not None) == (num_tokens <= DENSE_MAX_TOKENS)
    want = _cast(moe16, torch.float64)(x.double())  # same rounded weights, exact sums
    torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.02)


def test_dense_form_declined_for_a_shared_expert_of_another_width():
    moe = _cast(_moe(torch.Generator().manual_seed(3), shared_inter=12), torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert moe._dense_form() is None
    want = _cast(moe, torch.float64)(x.double())
    torch.testing.assert_close(moe(x).double(), want, rtol=0.05, atol=0.02)  # the loop


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_qwen3_next_fused_projection_equals_the_two_products(tmp_path, rows):
    """bf16 Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba`` regrouped into one weight at
    load give the per-key-head split of the two products (transformers' regrouping into
    q | k | v, z, b, a), value for value; float32 keeps the two products."""
    from safetensors.torch import save_file

    from hybridkv.engine.models.gdn_projection import GDNShape, qwen3_next_projector
    from hybridkv.engine.models.loader import Checkpoint

    s = GDNShape(
        hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4
    )
    gen = torch.Generator().manual_seed(rows)
    ratio, dk, dv = 2, 8, 6
    per_head = 2 * dk + 2 * ratio * dv
    w_qkvz = torch.randn(s.num_k_heads * per_head, 64, generator=gen) * 0.2
    w_ba = torch.randn(2 * s.num_v_heads, 64, generator=gen) * 0.2
    save_file(
        {"p.in_proj_qkvz.weight": w_qkvz, "p.in_proj_ba.weight": w_ba}, tmp_path / "w.safetensors"
    )
    x = torch.randn(rows, 64, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        project = qwen3_next_projector(Checkpoint(tmp_path, dtype), "p", s)
        got = [project(x.to(dtype)) for _ in range(3)][-1]  # packed from the second call
        qkvz = F.linear(x.to(dtype), w_qkvz.to(dtype)).view(rows, 2, per_head)
        q, k, v, z = torch.split(qkvz, [dk, dk, ratio * dv, ratio * dv], dim=-1)
        b, a = torch.split(
            F.linear(x.to(dtype), w_ba.to(dtype)).view(rows, 2, 2 * ratio), ratio, -1
        )
        mixed = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], -1)
        want = (mixed, z.reshape(rows, -1), b.reshape(rows, -1), a.reshape(rows, -1))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_attention_qkv_as_one_product_in_bf16_only(rows):
    """bf16 attention without biases: q, k, v projections are row views of one fused
    weight (no second copy) and its product's column slices equal the three products
    value for value (packed, from the second call); float32 and biased layers keep
    three products."""
    from hybridkv.engine.models.attention_block import Attention, AttentionShape
    from hybridkv.engine.ops.packed_linear import linear

    gen = torch.Generator().manual_seed(rows)
    shape = AttentionShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, gated=True)

    def make(dtype, bias=None):
        w = [torch.randn(n, 64, generator=gen).to(dtype) * 0.2 for n in (128, 32, 32)]
        return Attention(
            shape=shape, q_proj=w[0], k_proj=w[1], v_proj=w[2],
            o_proj=torch.randn(64, 64, generator=gen).to(dtype),
            q_bias=bias, k_bias=None, v_bias=None, o_bias=None,
            q_norm=None, k_norm=None, rope=None, scale=0.25,
        ), w  # fmt: skip

    layer, (wq, wk, wv) = make(torch.bfloat16)
    assert layer.qkv_proj is not None and layer.qkv_proj.shape == (192, 64)
    for view, w in zip((layer.q_proj, layer.k_proj, layer.v_proj), (wq, wk, wv), strict=True):
        assert view.untyped_storage().data_ptr() == layer.qkv_proj.untyped_storage().data_ptr()
        assert torch.equal(view, w)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    fused = [linear(x, layer.qkv_proj) for _ in range(3)][-1]
    for cols, w in zip(
        (slice(0, 128), slice(128, 160), slice(160, 192)), (wq, wk, wv), strict=True
    ):
        assert torch.equal(fused[:, cols], F.linear(x, w))
    assert make(torch.float32)[0].qkv_proj is None
    assert make(torch.bfloat16, bias=torch.zeros(128, dtype=torch.bfloat16))[0].qkv_proj is None

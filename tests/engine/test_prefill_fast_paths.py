"""Elementwise shortcuts of the batched path give bit-identical values to the plain forms.

`delta_rule.prepare_grouped` normalises q, k per key head before repeating them to the
value heads; `GatedMLP` and the Gated DeltaNet output norm multiply in place; the
chunked rule's triangular solve runs on one thread (`delta_rule.one_thread`). Each is
compared with ``torch.equal`` against the form it replaces, on random inputs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hybridkv.engine.models.common import GatedMLP  # noqa: E402
from hybridkv.engine.ops import delta_rule  # noqa: E402
from tests.exactness.test_batched_kernels import gdn_layer  # noqa: E402


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_prepare_grouped_equals_prepare_on_repeated_heads(ratio):
    gen = torch.Generator().manual_seed(ratio)
    q, k = (torch.randn(3, 5, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(3, 5, 2 * ratio, 8, generator=gen)
    g, beta = (torch.rand(3, 5, 2 * ratio, generator=gen) for _ in range(2))
    want = delta_rule.prepare(
        q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2), v, g, beta
    )
    got = delta_rule.prepare_grouped(q, k, v, g, beta, ratio)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gated_mlp_in_place_equals_out_of_place(act):
    gen = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(24, 16, generator=gen) for _ in range(2))
    down = torch.randn(16, 24, generator=gen)
    x = torch.randn(5, 16, generator=gen)
    fn = F.silu if act == "silu" else F.gelu
    mlp = GatedMLP(gate=gate, up=up, down=down, act=fn)
    want = F.linear(fn(F.linear(x, gate)) * F.linear(x, up), down)
    assert torch.equal(mlp(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_gated_norm_equals_plain_form(dtype):
    layer = gdn_layer(torch.Generator().manual_seed(3))
    heads, dv = layer.shape.num_v_heads, layer.shape.head_v_dim
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, heads, dv, generator=gen).to(dtype)
    gate = torch.randn(6, heads, dv, generator=gen).to(dtype)
    layer.norm_weight = torch.randn(dv, generator=gen).to(dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + layer.eps)
    want = ((layer.norm_weight * normed.to(dtype)) * F.silu(gate.float())).to(dtype)
    got = layer._gated_norm(x, gate)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
    assert torch.equal(x.float(), xf)  # the input is not modified


def test_one_thread_restores_the_thread_count_on_error():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError), delta_rule.one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("length", "rows", "bias"), [(1, 3, False), (5, 3, True), (70, 4, True)])
def test_conv_taps_match_depthwise_conv1d(length, rows, bias):
    """`causal_conv_grid` (channels-last history, shifted multiply-adds) against the
    library's depthwise conv on the channels-first history: the history bit for bit, the
    outputs to float32 rounding (the taps are summed in the same order, but the library
    kernel may fuse differently)."""
    from hybridkv.engine.ops.state_batched import causal_conv_grid

    gen = torch.Generator().manual_seed(length)
    channels, kernel = 24, 4
    x = torch.randn(3, length, channels, generator=gen)
    state = torch.randn(3, channels, rows, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    out, history = causal_conv_grid(x, state, weight, b)
    want_history = torch.cat([state, x.transpose(1, 2)], dim=-1)
    assert torch.equal(history, want_history)
    window = want_history[:, :, rows - (kernel - 1) :]
    want = F.conv1d(window, weight[:, None, :], b, groups=channels).transpose(1, 2)
    assert out.shape == want.shape == (3, length, channels)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_offset_norm_equals_the_plain_form(dtype):
    """`bind_norm` precomputes ``1 + weight`` for the zero-centred norm: bit for bit the
    values `rms_norm_offset` computes per call."""
    from hybridkv.engine.models.common import bind_norm, rms_norm, rms_norm_offset

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    weight = (torch.randn(48, generator=gen) * 0.1).to(dtype)
    bound = bind_norm(rms_norm_offset, weight, 1e-6)
    assert torch.equal(bound(x), rms_norm_offset(x, weight, 1e-6))
    assert torch.equal(bind_norm(rms_norm, weight, 1e-6)(x), rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepare_grouped_heads_major_equals_default_layout(ratio, dtype):
    """The heads-major layout (for the chunked rule) holds exactly the default's values,
    and the chunked rule's transpose of it is already contiguous (no second copy)."""
    gen = torch.Generator().manual_seed(11 + ratio)
    q, k = (torch.randn(3, 70, 2, 16, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(3, 70, 2 * ratio, 8, generator=gen).to(dtype)
    g, beta = (torch.rand(3, 70, 2 * ratio, generator=gen) for _ in range(2))
    want = delta_rule.prepare_grouped(q, k, v, g, beta, ratio)
    got = delta_rule.prepare_grouped(q, k, v, g, beta, ratio, heads_major=True)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a, b)
    for x in got[:3]:
        assert x.transpose(1, 2).is_contiguous()
    state = torch.randn(3, 2 * ratio, 16, 8, generator=gen) * 0.3
    rows, ks = torch.arange(3), [70, 70, 64]
    for a, b in zip(
        delta_rule.delta_rule_chunked(*got, state, rows, ks),
        delta_rule.delta_rule_chunked(*want, state, rows, ks),
        strict=True,
    ):
        assert torch.equal(a, b)

"""The opt-in compiled paths (`hybridkv.engine.ops.compiled`): off by default, taken only by
reduced-precision CPU steps of at least `MIN_TOKENS` rows, and (slow: they compile)
equal to the eager forms within float32 / bf16 rounding."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.models.common import _rms_norm_scaled, rms_norm  # noqa: E402
from hybridkv.engine.ops import compiled, delta_rule  # noqa: E402


@pytest.fixture
def switched_on():
    was = compiled.enabled()
    compiled.enable()
    try:
        yield
    finally:
        compiled.enable(was)


def test_off_by_default_and_float32_never_applies(switched_on):
    rows = compiled.MIN_TOKENS
    assert compiled.applies(torch.zeros(rows, 8, dtype=torch.bfloat16))
    assert not compiled.applies(torch.zeros(rows - 1, 8, dtype=torch.bfloat16))  # decode
    assert not compiled.applies(torch.zeros(rows, 8))  # float32: the exactness contract
    compiled.enable(False)
    assert not compiled.applies(torch.zeros(rows, 8, dtype=torch.bfloat16))


def test_the_default_process_has_it_off():
    # Nothing in the default suite turns it on for good (the fixture restores it).
    assert not compiled.enabled()


@pytest.mark.slow
def test_compiled_norms_match_eager(switched_on):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(64, generator=gen)
    scale = 1.0 + weight * 0.1
    eager = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * scale).to(
        torch.bfloat16
    )
    torch.testing.assert_close(_rms_norm_scaled(x, scale, 1e-6), eager)
    w16 = weight.to(torch.bfloat16)
    compiled.enable(False)
    want = rms_norm(x, w16, 1e-6)
    compiled.enable()
    torch.testing.assert_close(rms_norm(x, w16, 1e-6), want)
    gate = torch.randn(100, 4, 16, generator=gen).to(torch.bfloat16)
    heads = x.view(100, 4, 16)
    got = compiled.gated_norm(heads, gate, w16[:16], 1e-6)
    xf = heads.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    ref = ((w16[:16] * normed) * torch.nn.functional.silu(gate.float())).to(torch.bfloat16)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_fused_chunked_rule_matches_eager():
    """``fused=True`` (compiled per-chunk algebra) against the eager chunked rule, on
    two row counts and a ragged last chunk (the dynamic shapes the engine meets)."""
    for rows, length in ((2, 150), (3, 70)):
        gen = torch.Generator().manual_seed(rows)
        q, k = (torch.randn(rows, length, 4, 16, generator=gen) for _ in range(2))
        v = torch.randn(rows, length, 4, 8, generator=gen)
        g, beta = (
            -torch.rand(rows, length, 4, generator=gen),
            torch.rand(rows, length, 4, generator=gen),
        )
        args = delta_rule.prepare(q, k, v, g, beta)
        state = torch.randn(rows, 4, 16, 8, generator=gen) * 0.3
        ks = [length] * rows
        eager = delta_rule.delta_rule_chunked(*args, state, torch.arange(rows), ks)
        fused = delta_rule.delta_rule_chunked(*args, state, torch.arange(rows), ks, fused=True)
        for a, b in zip(fused, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fused_prefill_prep_matches_eager():
    """The compiled conv + silu and the one-pass q / k preparation against the eager
    forms (bf16 inputs, float32 outputs within bf16 input rounding)."""
    from hybridkv.engine.ops.state_batched import causal_conv_grid

    gen = torch.Generator().manual_seed(5)
    for rows, length in ((2, 70), (3, 100)):
        x = torch.randn(rows, length, 12, generator=gen).to(torch.bfloat16)
        state = torch.randn(rows, 12, 3, generator=gen).to(torch.bfloat16)
        weight = torch.randn(12, 4, generator=gen).to(torch.bfloat16)
        out, history = causal_conv_grid(x, state, weight, None)
        fused, fused_history = causal_conv_grid(x, state, weight, None, silu=True)
        assert torch.equal(fused_history, history)
        torch.testing.assert_close(fused, torch.nn.functional.silu(out), rtol=2e-2, atol=2e-2)
        q, k = (
            torch.randn(rows, length, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(2)
        )
        v = torch.randn(rows, length, 4, 8, generator=gen).to(torch.bfloat16)
        g, beta = (
            -torch.rand(rows, length, 4, generator=gen),
            torch.rand(rows, length, 4, generator=gen),
        )
        want = delta_rule.prepare_grouped(q, k, v, g, beta, 2, heads_major=True)
        got = delta_rule.prepare_grouped(q, k, v, g, beta, 2, heads_major=True, fused=True)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(x.transpose(1, 2).is_contiguous() for x in got[:3])  # no copy in the rule


@pytest.mark.slow
def test_compiled_decode_step_matches_eager_kernel(switched_on):
    """`compiled.delta_step` after `delta_rule.decay_into` against the eager decode
    kernel on the same bf16 slots (outputs and new states to float32 rounding)."""
    gen = torch.Generator().manual_seed(9)
    rows, heads = 9, 4
    buffer = torch.randn(40, heads, 8, 16, generator=gen).to(torch.bfloat16)
    view = buffer[1 : 1 + 3 * rows : 3]
    assert compiled.decode_applies(view) and not compiled.decode_applies(view[:2])
    q, k = (torch.randn(rows, 1, heads, 16, generator=gen) for _ in range(2))
    v = torch.randn(rows, 1, heads, 8, generator=gen)
    g, beta = -torch.rand(rows, 1, heads, generator=gen), torch.rand(rows, 1, heads, generator=gen)
    stored = view.float()
    want = delta_rule.delta_rule_decode_(q, k, v, g, beta, stored)
    decayed = delta_rule.decay_into(torch.empty(stored.shape), view, g)
    got, new = compiled.delta_step(decayed, q, k, v, beta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, stored, rtol=1e-5, atol=1e-5)

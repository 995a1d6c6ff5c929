"""Round 10's prefill layouts (`engine.ops.compiled`, `engine.ops.delta_rule`): each change of
layout gives values `torch.equal` to the form it replaced. Slow: they compile."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hybridkv.engine.ops import compiled  # noqa: E402


@pytest.fixture
def switched_on():
    was = compiled.enabled()
    compiled.enable()
    try:
        yield
    finally:
        compiled.enable(was)


def _conv_silu_channels_first(
    history: torch.Tensor, taps: torch.Tensor, first: int, length: int
) -> torch.Tensor:
    """The graph `compiled.conv_silu` ran before round 10: taps ``[C, K]`` read per tap."""
    out = history[:, first : first + length] * taps[:, 0]
    for j in range(1, taps.shape[-1]):
        out = out + history[:, first + j : first + j + length] * taps[:, j]
    return F.silu(out)


@pytest.mark.slow
@pytest.mark.parametrize("rows, length", [(3, 70), (2, 130)])
def test_conv_taps_kc_equal_to_ck(switched_on, rows, length):
    gen = torch.Generator().manual_seed(rows)
    channels, kernel = 96, 4
    history = torch.randn(rows, length + kernel - 1, channels, generator=gen).bfloat16()
    taps = torch.randn(channels, kernel, generator=gen).bfloat16()
    before = compiled.get("test_conv_silu_channels_first", _conv_silu_channels_first)
    want = before(history, taps, 0, length)
    got = compiled.conv_silu(history, taps, 0, length)
    assert got.shape == (rows, length, channels)
    assert torch.equal(got, want)
    # a history with older columns than the kernel reads (``first`` > 0)
    longer = torch.cat([torch.randn(rows, 2, channels, generator=gen).bfloat16(), history], 1)
    assert torch.equal(compiled.conv_silu(longer, taps, 2, length), want)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_chunked_output_is_stored_tokens_major(switched_on, fused):
    """`delta_rule_chunked` returns ``o [R, L, H, dv]`` contiguous (the caller's reshape
    to the token stream is a view), with the values of the chunk outputs it copies in:
    each chunk's ``O`` recomputed from the captured-state formula agrees exactly."""
    from hybridkv.engine.ops import delta_rule

    gen = torch.Generator().manual_seed(5)
    rows, length, heads, dk, dv = 2, 150, 2, 16, 8
    q, k = (torch.randn(rows, length, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows, length, heads, dv, generator=gen)
    g = -torch.rand(rows, length, heads, generator=gen)
    beta = torch.rand(rows, length, heads, generator=gen)
    q, k, v, g, beta = delta_rule.prepare(q, k, v, g, beta)
    state = torch.randn(rows, heads, dk, dv, generator=gen) * 0.3
    out, _ = delta_rule.delta_rule_chunked(
        q, k, v, g, beta, state, torch.arange(rows), [length] * rows, fused=fused
    )
    assert out.shape == (rows, length, heads, dv)
    assert out.is_contiguous()
    assert out.reshape(rows * length, heads, dv).data_ptr() == out.data_ptr()
    # the first chunk from the initial state, by the eager per-chunk functions
    size = delta_rule.CHUNK_TOKENS
    qc, kc, vc = (x[:, :size].transpose(1, 2).contiguous() for x in (q, k, v))
    bc, gc = beta[:, :size].transpose(1, 2).contiguous(), g[:, :size].transpose(1, 2).contiguous()
    if not fused:
        system, rhs, cum, decay = delta_rule._chunk_system(kc, vc, bc, gc, state)
        u = torch.linalg.solve_triangular(
            system.reshape(-1, size, size),
            rhs.reshape(-1, size, dv),
            upper=False,
            unitriangular=True,
        ).view(rhs.shape)
        first = delta_rule._chunk_out(qc, kc, state, cum, decay, u)
        assert torch.equal(out[:, :size], first.transpose(1, 2))


def test_keep_freed_pages_on_glibc():
    """`scratch.keep_freed_pages` sets glibc's thresholds (True there), and allocations
    still work after it: a freed multi-megabyte tensor's memory is handed out again
    (the settings stay for the rest of the test process: memory is kept, nothing else)."""
    import platform

    from hybridkv.engine.ops import scratch

    done = scratch.keep_freed_pages()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert done is True
    else:
        assert done in (True, False)
    a = torch.ones(4 << 20)
    assert float(a.sum()) == float(4 << 20)
    del a
    b = torch.zeros(4 << 20)
    assert float(b.sum()) == 0.0


@pytest.mark.parametrize("size", [64, 22, 5])
def test_blocked_solve_matches_the_one_call_solve(size):
    """The fused path's blocked solve sums in another order than LAPACK's substitution:
    equal at float32 rounding (not bit for bit; only reduced-precision models take it,
    and their outputs are rounded to bf16 after), on systems shaped like the chunked
    rule's, with strong decays (tiny and subnormal coefficients) included."""
    from hybridkv.engine.ops import delta_rule

    gen = torch.Generator().manual_seed(size)
    batch = 6
    gates = -torch.rand(batch, size, generator=gen) * 8.0  # strong gates: decays to ~e^-500
    cum = gates.cumsum(-1)
    decay = (cum[:, :, None] - cum[:, None, :]).exp().tril(-1)
    k = torch.nn.functional.normalize(torch.randn(batch, size, 16, generator=gen), dim=-1)
    beta = torch.rand(batch, size, 1, generator=gen)
    system = beta * decay * (k @ k.transpose(-1, -2)) + torch.eye(size)
    rhs = torch.randn(batch, size, 12, generator=gen)
    want = delta_rule._solve_unit_lower(system, rhs)
    got = delta_rule._solve_unit_lower_blocked(system, rhs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(system @ got, rhs, rtol=1e-4, atol=1e-5)


def test_llm_keeps_freed_pages_on_the_cpu_unless_told_not_to():
    """`LLM` applies the malloc settings on the CPU by default and reports it; with
    ``keep_freed_pages=False`` it neither applies nor reports them."""
    import platform

    from hybridkv.demo import DEMO_MAIN
    from hybridkv.engine import LLM

    options = {"memory_bytes": 8 << 20, "max_model_len": 256}
    assert LLM(DEMO_MAIN, keep_freed_pages=False, **options).keeps_freed_pages is False
    on = LLM(DEMO_MAIN, **options)
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert on.keeps_freed_pages is True
    out = on.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)
    assert len(out[0].token_ids) == 3

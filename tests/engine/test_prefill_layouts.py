"""Round 10's prefill layouts (`engine.compiled`, `engine.delta_rule`): each change of
layout gives values `torch.equal` to the form it replaced. Slow: they compile."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hybridkv.engine import compiled  # noqa: E402


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

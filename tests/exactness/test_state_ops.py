"""State ops: a conv state with extra rows (kept for speculative tokens) changes nothing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.ops.state_ops import causal_conv1d  # noqa: E402


def test_conv_state_with_extra_rows_gives_same_output_and_longer_history():
    torch.manual_seed(0)
    channels, kernel = 6, 4
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    first, second = torch.randn(5, channels), torch.randn(2, channels)

    minimal = torch.zeros(channels, kernel - 1)
    wide = torch.zeros(channels, kernel - 1 + 3)
    out_min, minimal = causal_conv1d(first, minimal, weight, bias)
    out_wide, wide = causal_conv1d(first, wide, weight, bias)
    torch.testing.assert_close(out_min, out_wide)
    torch.testing.assert_close(wide[:, -(kernel - 1) :], minimal)
    # The last 6 inputs, oldest first: one zero from the empty start, then all 5 tokens.
    torch.testing.assert_close(wide, torch.cat([torch.zeros(channels, 1), first.T], dim=1))

    out_min, _ = causal_conv1d(second, minimal, weight, bias)
    out_wide, _ = causal_conv1d(second, wide, weight, bias)
    torch.testing.assert_close(out_min, out_wide)
    whole, _ = causal_conv1d(torch.cat([first, second]), torch.zeros(channels, 3), weight, bias)
    torch.testing.assert_close(out_min, whole[-2:])

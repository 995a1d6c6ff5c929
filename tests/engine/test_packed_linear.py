"""`packed_linear.linear`: bit-identical to ``F.linear``; packs bf16 CPU weights only, and
only where the CPU and torch build have oneDNN bf16 products (`packed_linear.ENABLED`):
elsewhere every call goes to ``F.linear`` and nothing is packed. Each test checks the
machine it runs on either way (no skip)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.ops import packed_linear
from hybridkv.engine.ops.packed_linear import linear


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
def test_packed_bf16_equals_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(384, 256, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 512, generator=gen).to(torch.bfloat16)[:, ::2]  # strided rows
    outs = [linear(x, weight) for _ in range(3)]  # plain, then packed on the second sight
    assert hasattr(weight, "_hybridkv_packed") == packed_linear.ENABLED
    for out in outs:
        assert torch.equal(out, F.linear(x, weight))


def test_fresh_tensors_are_never_packed() -> None:
    stacked = torch.randn(4, 64, 32).to(torch.bfloat16)
    x = torch.randn(2, 32).to(torch.bfloat16)
    for _ in range(3):
        view = stacked[1]  # a new view object per call
        assert torch.equal(linear(x, view), F.linear(x, view))
        assert not hasattr(view, "_hybridkv_packed")


def test_float32_and_bias_go_to_f_linear() -> None:
    weight = torch.randn(16, 8)
    bias = torch.randn(16)
    x = torch.randn(5, 8)
    for _ in range(3):
        assert torch.equal(linear(x, weight), F.linear(x, weight))
        assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    assert not hasattr(weight, "_hybridkv_packed")
    wb = weight.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    for _ in range(3):
        assert torch.equal(
            linear(xb, wb, bias.to(torch.bfloat16)), F.linear(xb, wb, bias.bfloat16())
        )

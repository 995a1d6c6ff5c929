"""`attention._grouped_sdpa`: GQA with query heads folded into rows, as plain SDPA computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.ops.attention import SHORT_MAX_TOKENS, _grouped_pays, _grouped_sdpa


def _inputs(rows: int, length: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_keys = 40
    q = torch.randn(rows, 8, length, 16, generator=gen).to(dtype)
    k = torch.randn(rows, 2, num_keys, 16, generator=gen).to(dtype)
    v = torch.randn(rows, 2, num_keys, 16, generator=gen).to(dtype)
    ends = torch.randint(length, num_keys + 1, (rows,), generator=gen)  # ragged rows
    q_pos = ends[:, None] - length + torch.arange(length)[None, :]
    mask = torch.arange(num_keys)[None, None, :] <= q_pos[:, :, None]  # causal, ragged
    return q, k, v, mask[:, None]


@pytest.mark.parametrize("rows,length", [(1, 1), (5, 1), (32, 1), (3, 4)])
def test_grouped_matches_plain_sdpa(rows: int, length: int) -> None:
    q, k, v, mask = _inputs(rows, length, torch.float32, rows * 10 + length)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    folded = _grouped_sdpa(q, k, v, mask, 0.25)
    torch.testing.assert_close(folded, plain, rtol=1e-5, atol=1e-6)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    folded_bf16 = _grouped_sdpa(qb, kb, vb, mask, 0.25)
    # bf16 inputs and output: a few units of bf16 rounding (2 ** -8 relative) at most
    torch.testing.assert_close(folded_bf16.float(), plain, rtol=0.03, atol=0.03)


def test_grouped_only_for_short_bf16_gqa_on_cpu() -> None:
    q, k, _, _ = _inputs(2, 1, torch.bfloat16, 0)
    assert _grouped_pays(q, k)
    assert not _grouped_pays(q.float(), k.float())  # float32 keeps the plain call
    assert not _grouped_pays(q, q)  # no GQA: nothing to fold
    long_q = torch.zeros(2, 8, SHORT_MAX_TOKENS + 1, 16, dtype=torch.bfloat16)
    assert not _grouped_pays(long_q, k)

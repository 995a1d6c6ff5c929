"""Projections of one input as one matrix product: fused weights, split outputs.

Serving engines multiply a layer's input once by the stacked q/k/v (or gate/up, or a
Gated DeltaNet's qkv/z) weights instead of once per projection: at decode (a few dozen
rows) each product is small, and one wider product runs closer to the matmul's peak.

It must not change a bit (the engine is token-exact against `transformers`, which
multiplies the parts one by one). Measured on CPU, float32, 1 and 2 threads, 1 to 8192
rows (`tests/engine/test_fused_projections.py` checks it with `torch.equal`):
- wide parts are bit-identical fused or apart; parts of 8 rows are not (a narrow
  product takes another kernel), so a part joins only if it has >= `MIN_PART_ROWS` rows;
- elementwise ops on a part (silu, rope, norms) see a strided view; their vectorised
  loop then leaves a scalar tail per row unless the row length is a multiple of the
  vector width (silu differed at 1000 columns), so every part must be a multiple of
  `PART_MULTIPLE` rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_PART_ROWS = 64
PART_MULTIPLE = 64  # >= two AVX-512 float vectors


def can_fuse(sizes: Sequence[int]) -> bool:
    """True if projections with these output sizes may share one product."""
    return len(sizes) > 1 and all(s >= MIN_PART_ROWS and s % PART_MULTIPLE == 0 for s in sizes)


def fuse(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stacked weight and each part as a view of it (so memory is not doubled)."""
    stacked = torch.cat(list(weights), dim=0)
    parts, start = [], 0
    for w in weights:
        parts.append(stacked[start : start + w.shape[0]])
        start += w.shape[0]
    return stacked, parts

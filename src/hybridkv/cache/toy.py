"""Small hand-made `CachePlan`s for tests and examples.

``toy_plan([ToyGroup("full", 4), ToyGroup("state", 8)], num_blocks=20)`` builds a
plan whose groups have exactly these block sizes, with one shared pool of 20 blocks
(block 0 null, 19 usable), or with ``layout="split"`` one pool of 20 blocks per group.
Byte sizes are nominal; only the block arithmetic matters to the cache manager. The
plans come from `hybridkv.plan.nominal`, which production code uses directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.plan.nominal import GroupShape, nominal_plan
from hybridkv.plan.types import CachePlan

ToyGroup = GroupShape


def toy_plan(
    groups: Sequence[ToyGroup],
    *,
    num_blocks: int = 64,
    layout: str = "shared",
    num_spec_tokens: int = 0,
    state_mode: str = "align",
    prefix_caching: bool = True,
) -> CachePlan:
    return nominal_plan(
        groups,
        num_blocks=num_blocks,
        layout=layout,
        num_spec_tokens=num_spec_tokens,
        state_mode=state_mode,
        prefix_caching=prefix_caching,
        main_model="toy",
    )

"""Small hand-made `CachePlan`s for tests, examples and the simulator's unit tests.

``toy_plan([ToyGroup("full", 4), ToyGroup("state", 8)], num_blocks=20)`` builds a
plan whose groups have exactly these block sizes, with one shared pool of 20 blocks
(block 0 null, 19 usable), or with ``layout="split"`` one pool of 20 blocks per group.
Byte sizes are nominal; only the block arithmetic matters to the cache manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.plan.types import (
    CachePlan,
    Capacity,
    GroupPlan,
    LayerRef,
    PlanOptions,
    PoolPlan,
)
from hybridkv.spec.layers import (
    AttentionSpec,
    ChunkedLocalSpec,
    GatedDeltaNetSpec,
    LayerSpec,
    MLASpec,
    SlidingWindowSpec,
)


@dataclass(frozen=True)
class ToyGroup:
    kind: str  # full | mla | sliding | chunked | state
    block_size: int
    span_tokens: int = 0  # window (sliding) or chunk (chunked)
    model: str = "main"


def _spec(group: ToyGroup) -> LayerSpec:
    if group.kind == "full":
        return AttentionSpec(num_kv_heads=1, head_dim=8)
    if group.kind == "mla":
        return MLASpec(kv_lora_rank=8, qk_rope_head_dim=4)
    if group.kind == "sliding":
        return SlidingWindowSpec(num_kv_heads=1, head_dim=8, sliding_window=group.span_tokens)
    if group.kind == "chunked":
        return ChunkedLocalSpec(num_kv_heads=1, head_dim=8, attention_chunk_size=group.span_tokens)
    if group.kind == "state":
        return GatedDeltaNetSpec(
            num_k_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=4, conv_kernel=4
        )
    raise ValueError(f"unknown toy group kind {group.kind!r}")


def toy_plan(
    groups: Sequence[ToyGroup],
    *,
    num_blocks: int = 64,
    layout: str = "shared",
    num_spec_tokens: int = 0,
    state_mode: str = "align",
    prefix_caching: bool = True,
) -> CachePlan:
    options = PlanOptions(
        spec_method="draft" if num_spec_tokens else None,
        num_spec_tokens=num_spec_tokens,
        prefix_caching=prefix_caching,
        state_mode=state_mode,
        layout=layout,
    )
    group_plans = []
    for gid, group in enumerate(groups):
        spec = _spec(group)
        page = spec.page_bytes(group.block_size, num_spec_tokens)
        group_plans.append(
            GroupPlan(
                group_id=gid,
                model=group.model,
                spec=spec,
                layers=(LayerRef(model=group.model, index=gid),),
                block_size=group.block_size,
                page_bytes=page,
                padded_page_bytes=page,
                pool_id=0 if layout == "shared" else gid,
                num_spec_states=options.num_spec_states if group.kind == "state" else 0,
                state_mode=state_mode if group.kind == "state" else "none",
            )
        )
    if layout == "shared":
        pools: tuple[PoolPlan, ...] = (
            PoolPlan(
                pool_id=0,
                page_bytes=4096,
                num_pages=num_blocks,
                num_tensors=len(groups),
                group_ids=tuple(range(len(groups))),
            ),
        )
    else:
        pools = tuple(
            PoolPlan(
                pool_id=g, page_bytes=4096, num_pages=num_blocks, num_tensors=1, group_ids=(g,)
            )
            for g in range(len(groups))
        )
    capacity = Capacity(
        max_model_len=4096,
        target_len=4096,
        typical_len=4096,
        blocks_per_request_at_target={},
        max_concurrency=0,
        max_concurrency_float=0.0,
        concurrency_at_typical=0,
        tokens_per_group={},
        state_slots=0,
        max_num_seqs=256,
        max_num_seqs_that_fit=0,
    )
    return CachePlan(
        layout=layout,
        main_model="toy",
        draft_model=None,
        options=options,
        groups=tuple(group_plans),
        pools=pools,
        tensors=(),
        capacity=capacity,
        memory_bytes=0,
        used_bytes=0,
        waste_bytes=0,
        hit_granularity_tokens=max(g.block_size for g in groups),
    )

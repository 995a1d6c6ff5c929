"""Plans that fix only the block arithmetic: group kinds, block sizes, one pool size.

Where something else has already placed the tensors (vLLM's KV-cache config, for
`hybridkv.vllm.kv_plan`) or no memory exists at all (hand-made plans in tests), the
cache manager still needs a `CachePlan`: each group's kind, block size and window or
chunk, the number of blocks per pool, the speculative rows and the state mode. Byte
sizes are nominal (tiny specs, 4096-byte pool pages) and capacity is left at zero.

``nominal_plan([GroupShape("full", 4), GroupShape("state", 8)], num_blocks=20)`` has
two groups with exactly these block sizes in one shared pool of 20 block ids (id 0
the null block, 19 usable); with ``layout="split"`` each group gets its own pool of
20.
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

NOMINAL_PAGE_BYTES = 4096
NOMINAL_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class GroupShape:
    """One group's block arithmetic."""

    kind: str  # full | mla | sliding | chunked | state
    block_size: int
    span_tokens: int = 0  # window (sliding) or chunk (chunked)
    model: str = "main"


def _spec(group: GroupShape) -> LayerSpec:
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
    raise ValueError(f"unknown group kind {group.kind!r}")


def _pools(num_groups: int, num_blocks: int, layout: str) -> tuple[PoolPlan, ...]:
    if layout == "shared":
        return (
            PoolPlan(
                pool_id=0,
                page_bytes=NOMINAL_PAGE_BYTES,
                num_pages=num_blocks,
                num_tensors=num_groups,
                group_ids=tuple(range(num_groups)),
            ),
        )
    return tuple(
        PoolPlan(
            pool_id=g,
            page_bytes=NOMINAL_PAGE_BYTES,
            num_pages=num_blocks,
            num_tensors=1,
            group_ids=(g,),
        )
        for g in range(num_groups)
    )


def nominal_plan(
    groups: Sequence[GroupShape],
    *,
    num_blocks: int = 64,
    layout: str = "shared",
    num_spec_tokens: int = 0,
    state_mode: str = "align",
    prefix_caching: bool = True,
    main_model: str = "nominal",
) -> CachePlan:
    """A `CachePlan` with these groups (group id = position) and ``num_blocks`` ids per
    pool; ``layout`` is ``shared`` (one pool) or ``split`` (one pool per group)."""
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
    capacity = Capacity(
        max_model_len=NOMINAL_MAX_MODEL_LEN,
        target_len=NOMINAL_MAX_MODEL_LEN,
        typical_len=NOMINAL_MAX_MODEL_LEN,
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
        main_model=main_model,
        draft_model=None,
        options=options,
        groups=tuple(group_plans),
        pools=_pools(len(groups), num_blocks, layout),
        tensors=(),
        capacity=capacity,
        memory_bytes=0,
        used_bytes=0,
        waste_bytes=0,
        hit_granularity_tokens=max(g.block_size for g in groups),
    )

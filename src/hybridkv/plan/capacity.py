"""Sizing pools, placing tensors and computing capacity: `LayoutDraft` -> `CachePlan`.

Capacity uses `plan.peak.peak_blocks` over the specs' `blocks_needed`, the same
formula the cache manager allocates by, so the two cannot disagree. For a pool shared
by groups ``G``, requests decoding to ``L`` tokens with ``K`` drafts per step::

    concurrency(L) = usable_blocks // peak_blocks(G, L, 1, K)

(the most blocks one request holds at once in ``G`` at any step on its way to ``L``)
and the plan's concurrency is the minimum over pools.
"""

from __future__ import annotations

from math import lcm

from hybridkv.errors import PlanError
from hybridkv.ids import cdiv
from hybridkv.plan.layouts import LayoutDraft, split_prefill_reserve_blocks
from hybridkv.plan.peak import peak_blocks
from hybridkv.plan.types import (
    CachePlan,
    Capacity,
    GroupPlan,
    PlanOptions,
    PoolPlan,
    TensorPlacement,
)
from hybridkv.spec.attention import ChunkedLocalSpec, SlidingWindowSpec
from hybridkv.spec.layers import FULL_ATTENTION, MLA, STATE

GROWING_KINDS = (FULL_ATTENTION, MLA)  # kinds whose blocks per request grow without bound


def _groups(draft: LayoutDraft, options: PlanOptions) -> tuple[GroupPlan, ...]:
    mode = options.resolved_state_mode
    return tuple(
        GroupPlan(
            group_id=gid,
            model=g.cls.model,
            spec=g.cls.spec,
            layers=g.layers,
            block_size=g.block_size,
            page_bytes=g.page_bytes,
            padded_page_bytes=g.padded_page_bytes,
            pool_id=g.pool,
            # only state groups keep speculative states and checkpoints
            num_spec_states=options.num_spec_states if g.cls.is_state else 0,
            state_mode=mode if g.cls.is_state else "none",
        )
        for gid, g in enumerate(draft.groups)
    )


def _split_pages(
    draft: LayoutDraft, groups: tuple[GroupPlan, ...], options: PlanOptions, target: int
) -> list[int]:
    """Static split: state and window pools for min(requests that fit, max_num_seqs)
    requests at ``target`` tokens; full-attention pools share the rest in proportion to
    their bytes per token (every request needs all of them for each token)."""
    k = options.num_spec_tokens
    slabs = [draft.pool_page_bytes[g.pool_id] * draft.pool_num_tensors[g.pool_id] for g in groups]
    available = options.memory_bytes - sum(slabs)  # one null page per pool
    per_request = sum(g.blocks_needed(target, k) * s for g, s in zip(groups, slabs, strict=True))
    # A window pool's prefill reserve is linear in the request count (fixed + n blocks):
    # budget both parts before deciding how many requests fit, so the pools stay in budget.
    for g, slab in zip(groups, slabs, strict=True):
        if isinstance(g.spec, SlidingWindowSpec | ChunkedLocalSpec):
            fixed = split_prefill_reserve_blocks(g.spec, g.block_size, options, 0, target)
            available -= fixed * slab
            per_request += (
                split_prefill_reserve_blocks(g.spec, g.block_size, options, 1, target) - fixed
            ) * slab
    if available < 0:
        raise PlanError(
            f"split layout: the window pools' prefill reserve (one step of "
            f"{min(options.max_num_batched_tokens, target)} tokens) and null pages need "
            f"{options.memory_bytes - available} bytes, more than the {options.memory_bytes} "
            "byte budget; raise --memory, lower --max-num-batched-tokens, or use the shared "
            "layout"
        )
    fits = available // per_request if per_request else options.max_num_seqs
    num_requests = min(fits, options.max_num_seqs)
    available = options.memory_bytes - sum(slabs)
    pages = [0] * len(draft.pool_page_bytes)
    growing: list[int] = []
    for g, slab in zip(groups, slabs, strict=True):
        if g.kind not in GROWING_KINDS:
            blocks = num_requests * g.blocks_needed(target, k)
            if isinstance(g.spec, SlidingWindowSpec | ChunkedLocalSpec):  # room to prefill
                blocks += split_prefill_reserve_blocks(
                    g.spec, g.block_size, options, num_requests, target
                )
            pages[g.pool_id] = blocks + 1
            available -= blocks * slab
        else:
            growing.append(g.group_id)
    weight = {gid: slabs[gid] / groups[gid].block_size for gid in growing}
    total_weight = sum(weight.values())
    for gid in growing:
        share = max(available, 0) * weight[gid] / total_weight
        pages[groups[gid].pool_id] = int(share // slabs[gid]) + 1
    return pages


def pool_request_blocks(
    groups: tuple[GroupPlan, ...], pool: PoolPlan, num_tokens: int, num_lookahead: int
) -> int:
    """Peak blocks one request at ``num_tokens`` tokens takes from ``pool``."""
    return peak_blocks([groups[i] for i in pool.group_ids], num_tokens, 1, num_lookahead)


def _tokens_per_group(
    groups: tuple[GroupPlan, ...], pools: tuple[PoolPlan, ...], k: int, target: int, num: int
) -> dict[int, int]:
    """Context tokens each token-indexed group holds with ``num`` requests running.

    Every request needs every group, so a group cannot hold more than its pool leaves
    it once the others have what the same requests need: bounded groups (state,
    windows) their peak for ``num`` requests at ``target`` tokens, growing groups (full
    attention, MLA) the same tokens as this one. Per pool, the largest per-request
    length ``t`` such that ``num`` requests of ``t`` tokens fit; a growing group holds
    ``num * t`` tokens, a window group the tokens its live blocks cover.
    """
    out: dict[int, int] = {}
    for pool in pools:
        members = [groups[i] for i in pool.group_ids]
        growing = [g for g in members if g.blocks_period() is None]
        bounded = [g for g in members if g.blocks_period() is not None]
        fixed = num * peak_blocks(bounded, target, 1, k)
        left = pool.num_usable_blocks - fixed
        t = 0
        if growing and left > 0:
            lo, hi = 0, left * max(g.block_size for g in growing)  # tokens per request
            while lo < hi:  # largest t with num * sum(cdiv(t + k, B)) <= left
                mid = (lo + hi + 1) // 2
                if num * sum(cdiv(mid + k, g.block_size) for g in growing) <= left:
                    lo = mid
                else:
                    hi = mid - 1
            t = lo
        for g in growing:
            out[g.group_id] = num * t
        for g in bounded:
            if not g.is_state:
                out[g.group_id] = num * g.blocks_needed(target, k) * g.block_size
    return out


def _capacity(
    groups: tuple[GroupPlan, ...],
    pools: tuple[PoolPlan, ...],
    options: PlanOptions,
    max_model_len: int,
    target: int,
    typical: int,
) -> Capacity:
    k = options.num_spec_tokens

    def concurrency(length: int, only_state: bool = False) -> tuple[int, float]:
        whole, frac = None, None
        for pool in pools:
            members = [groups[i] for i in pool.group_ids if not only_state or groups[i].is_state]
            need = peak_blocks(members, length, 1, k)
            if not need:
                continue
            n, f = pool.num_usable_blocks // need, pool.num_usable_blocks / need
            whole = n if whole is None else min(whole, n)
            frac = f if frac is None else min(frac, f)
        return (whole or 0, frac or 0.0) if whole is not None else (10**9, float(10**9))

    at_target, at_target_float = concurrency(target)
    state_slots, _ = concurrency(1, only_state=True)
    seqs_that_fit, _ = concurrency(1)
    return Capacity(
        max_model_len=max_model_len,
        target_len=target,
        typical_len=typical,
        blocks_per_request_at_target={g.group_id: g.blocks_needed(target, k) for g in groups},
        max_concurrency=at_target,
        max_concurrency_float=at_target_float,
        concurrency_at_typical=concurrency(typical)[0],
        tokens_per_group=_tokens_per_group(groups, pools, k, target, max(at_target, 1)),
        state_slots=state_slots if any(g.is_state for g in groups) else 0,
        max_num_seqs=options.max_num_seqs,
        max_num_seqs_that_fit=seqs_that_fit,
    )


def _placements(
    groups: tuple[GroupPlan, ...], pools: tuple[PoolPlan, ...]
) -> tuple[TensorPlacement, ...]:
    placed = []
    for g in groups:
        pool = pools[g.pool_id]
        for tensor_index, ref in enumerate(g.layers):
            if pool.packing == "slab":  # side by side inside each slab
                offset = tensor_index * g.padded_page_bytes
            else:  # one tensor slot (num_pages pages) per layer
                offset = tensor_index * pool.num_pages * pool.page_bytes
            placed.append(
                TensorPlacement(
                    layer=ref,
                    group_id=g.group_id,
                    pool_id=pool.pool_id,
                    tensor_index=tensor_index,
                    offset_bytes=offset,
                    page_stride_bytes=pool.page_bytes,
                    used_bytes=g.page_bytes,
                )
            )
    return tuple(placed)


def _waste_bytes(
    groups: tuple[GroupPlan, ...], pools: tuple[PoolPlan, ...], options: PlanOptions, target: int
) -> int:
    """Padding (and idle tensor slots) in each pool, weighted by the block mix of
    requests at ``target`` tokens: the share of a full pool that holds no data."""
    waste = 0.0
    for pool in pools:
        used = padded = 0
        for gid in pool.group_ids:
            g = groups[gid]
            blocks = g.blocks_needed(target, options.num_spec_tokens)
            used += blocks * pool.slab_bytes
            padded += blocks * (pool.slab_bytes - g.page_bytes * len(g.layers))
        if used:
            waste += pool.total_bytes * padded / used
    return int(waste)


def build_plan(
    draft: LayoutDraft,
    options: PlanOptions,
    *,
    main_name: str,
    draft_name: str | None,
    max_model_len: int,
    target: int,
    typical: int,
) -> CachePlan:
    groups = _groups(draft, options)
    if draft.pool_num_pages is not None:
        pages = draft.pool_num_pages
    elif draft.name == "split":
        pages = _split_pages(draft, groups, options, target)
    else:
        slab = draft.pool_page_bytes[0] * draft.pool_num_tensors[0]
        pages = [options.memory_bytes // slab]
    for pid, count in enumerate(pages):
        slab = draft.pool_page_bytes[pid] * draft.pool_num_tensors[pid]
        if count < 2:
            raise PlanError(
                f"layout {draft.name}: memory {options.memory_bytes} bytes leaves pool {pid} "
                f"{count} pages of {slab} bytes (a null page plus at least one block are "
                "needed); raise --memory or lower --max-model-len / --max-num-seqs"
            )
    pools = tuple(
        PoolPlan(
            pool_id=pid,
            page_bytes=draft.pool_page_bytes[pid],
            num_pages=pages[pid],
            num_tensors=draft.pool_num_tensors[pid],
            group_ids=tuple(g.group_id for g in groups if g.pool_id == pid),
            packing=draft.packing,
        )
        for pid in range(len(draft.pool_page_bytes))
    )
    capacity = _capacity(groups, pools, options, max_model_len, target, typical)
    hit_groups = [g for g in groups if g.kind != STATE or g.state_mode in ("align", "all")]
    granularity = lcm(*(g.block_size for g in hit_groups)) if hit_groups else 0
    return CachePlan(
        layout=draft.name,
        main_model=main_name,
        draft_model=draft_name,
        options=options,
        groups=groups,
        pools=pools,
        tensors=_placements(groups, pools),
        capacity=capacity,
        memory_bytes=options.memory_bytes,
        used_bytes=sum(p.total_bytes for p in pools),
        waste_bytes=_waste_bytes(groups, pools, options, target),
        hit_granularity_tokens=granularity if options.prefix_caching else 0,
        warnings=tuple(draft.notes),
    )

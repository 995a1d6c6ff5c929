"""Invariants every `CachePlan` must satisfy; the property tests check them."""

from __future__ import annotations

from hybridkv.errors import InvariantError
from hybridkv.plan.peak import peak_blocks
from hybridkv.plan.types import CachePlan


def check_plan_invariants(plan: CachePlan) -> None:
    """Raise `InvariantError` when the plan contradicts itself.

    * one page size per pool: every group's padded page is that size (tensor packing)
      or its layers' pages fill at most one slab (slab packing);
    * padded page >= raw page, and a group never has more layers than tensor slots;
    * total pool bytes within the budget;
    * every layer of both models placed exactly once, at a distinct (pool, tensor);
    * capacity equals what the pools hold (recomputed with `plan.peak.peak_blocks`).
    """

    def fail(message: str) -> InvariantError:
        return InvariantError(f"plan ({plan.layout}): {message}")

    for g in plan.groups:
        pool = plan.pools[g.pool_id]
        if pool.packing == "tensor" and g.padded_page_bytes != pool.page_bytes:
            raise fail(f"group {g.group_id} page {g.padded_page_bytes} != pool {pool.page_bytes}")
        if g.padded_page_bytes < g.page_bytes:
            raise fail(f"group {g.group_id} padded {g.padded_page_bytes} < raw {g.page_bytes}")
        if len(g.layers) * g.padded_page_bytes > pool.slab_bytes:
            raise fail(
                f"group {g.group_id}: {len(g.layers)} layers x {g.padded_page_bytes} B "
                f"exceed the pool's {pool.slab_bytes} B slab"
            )
        if g.block_size < 1:
            raise fail(f"group {g.group_id} block size {g.block_size}")
        if g.group_id not in pool.group_ids:
            raise fail(f"group {g.group_id} missing from pool {pool.pool_id}")
    if plan.used_bytes > plan.memory_bytes:
        raise fail(f"pools use {plan.used_bytes} bytes > budget {plan.memory_bytes}")
    if plan.used_bytes != sum(p.total_bytes for p in plan.pools):
        raise fail("used_bytes is not the sum of the pools")
    names = [t.layer.name for t in plan.tensors]
    if len(names) != len(set(names)) or len(names) != sum(len(g.layers) for g in plan.groups):
        raise fail("a layer is placed twice or not at all")
    slots = {(t.group_id, t.pool_id, t.tensor_index) for t in plan.tensors}
    if len(slots) != len(plan.tensors):
        raise fail("two layers of one group share a tensor slot")
    for t in plan.tensors:
        pool = plan.pools[t.pool_id]
        end = t.offset_bytes + (pool.num_pages - 1) * t.page_stride_bytes + t.used_bytes
        if end > pool.total_bytes:
            raise fail(f"layer {t.layer.name} ends at {end} > pool bytes {pool.total_bytes}")
    k = plan.options.num_spec_tokens
    target = plan.capacity.target_len
    for pool in plan.pools:
        need = peak_blocks([plan.groups[i] for i in pool.group_ids], target, 1, k)
        if need and plan.capacity.max_concurrency > pool.num_usable_blocks // need:
            raise fail(
                f"capacity {plan.capacity.max_concurrency} requests but pool {pool.pool_id} "
                f"holds only {pool.num_usable_blocks // need}"
            )

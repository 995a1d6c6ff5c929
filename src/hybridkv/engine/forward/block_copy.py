"""Junction copies (`hybridkv.cache.junction`): before a step runs, copy the first
slots of a cached attention block into the fresh block of a request whose prefix hit
ends inside that block (copy-on-write: the source stays cached for its own hits and
its own request may still write past the copied slots).

Each `CopyOrder` names a token-indexed group; every attention layer of the main model
and of a separate draft model addressed by that group's table gets its K and V slots
``[0, num_tokens)`` of the destination page overwritten from the source page. fp8
pages carry per-tensor scales (`KVCache.quant`), so copying the bytes is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from hybridkv.cache.delta import StepDelta
from hybridkv.cache.junction import CopyOrder
from hybridkv.engine.forward.tensors import CacheTensors, group_key
from hybridkv.engine.ops.context import KVCache
from hybridkv.errors import EngineError


def step_copies(deltas: Mapping[str, StepDelta]) -> list[CopyOrder]:
    """Every copy order of one scheduler step (admissions only hold them)."""
    out: list[CopyOrder] = []
    for delta in deltas.values():
        out.extend(delta.copies)
    return out


@torch.no_grad()
def run_copies(tensors: CacheTensors, orders: Iterable[CopyOrder]) -> int:
    """Run ``orders`` on every K/V view of their groups; returns the slots copied (per
    layer, summed over orders) for counters and tests."""
    orders = list(orders)
    if not orders:
        return 0
    by_group: dict[str, list[KVCache]] = {}
    for model_caches in (tensors.caches, tensors.draft_caches):
        for layer in model_caches.values():
            if isinstance(layer, KVCache):
                by_group.setdefault(layer.group, []).append(layer)
    copied = 0
    for order in orders:
        views = by_group.get(group_key(order.group_id))
        if views is None:
            raise EngineError(
                f"copy order for group {order.group_id}: no attention layer uses that group; "
                "the plan and the cache tensors disagree"
            )
        n = order.num_tokens
        for cache in views:
            if not 0 < n <= cache.key.shape[1]:
                raise EngineError(
                    f"copy order for group {order.group_id}: {n} slots, block holds "
                    f"{cache.key.shape[1]}"
                )
            cache.key[order.dst_block, :n] = cache.key[order.src_block, :n]
            cache.value[order.dst_block, :n] = cache.value[order.src_block, :n]
        copied += n
    return copied

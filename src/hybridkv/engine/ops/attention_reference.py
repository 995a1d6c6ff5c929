"""Paged attention, one request at a time: the readable oracle of `attention`.

Pages are ``[num_blocks, block_size, num_kv_heads, head_dim]``; token position ``p`` of
a request lives at flat slot ``block_ids[p // block_size] * block_size + p % block_size``.
Example with block_size 4 and block_ids [7, 2]:

    position   0  1  2  3 | 4  5  6
    block      7  7  7  7 | 2  2  2
    slot      28 29 30 31 | 8  9 10

A sliding-window layer with window W lets the token at position p see keys in
(p - W, p], so a step whose first new token is at position c reads keys from
``max(0, c - W + 1)`` on. Blocks wholly before that may be the null block (id 0) and
are never read.

This is the reference implementation: one request at a time, scores materialised in
full, correctness and readability over speed. The engine runs `attention.paged_attention`
(the whole batch in a few tensor ops); tests check one against the other.
"""

from __future__ import annotations

import torch

from hybridkv.engine.ops.context import BlockTable, ForwardBatch, KVCache
from hybridkv.engine.ops.kv_io import load_kv, store_kv
from hybridkv.errors import EngineError


def slot_mapping(block_ids: torch.Tensor, block_size: int, positions: torch.Tensor) -> torch.Tensor:
    """Flat cache slots of ``positions`` (one request) given its row of block ids."""
    logical_blocks = positions // block_size
    if int(logical_blocks.max()) >= block_ids.numel():
        raise EngineError(
            f"position {int(positions.max())} needs logical block {int(logical_blocks.max())} "
            f"but the block table row has only {block_ids.numel()} entries "
            f"(block_size {block_size})"
        )
    return block_ids.long()[logical_blocks] * block_size + positions % block_size


def page_index(
    block_ids: torch.Tensor, block_size: int, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block id, offset in block)`` of ``positions``: indexes ``[num_blocks, block_size,
    ...]`` pages directly, so the pages may be strided views into a pool (a layer's pages
    are not contiguous there: K and V of one page sit side by side)."""
    flat = slot_mapping(block_ids, block_size, positions)
    return flat // block_size, flat % block_size


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    batch: ForwardBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store ``k``/``v`` of the new tokens in ``cache``, then causal attention per request.

    ``q`` is ``[T, num_heads, head_dim]``, ``k`` ``[T, num_kv_heads, head_dim]`` and ``v``
    ``[T, num_kv_heads, v_head_dim]``; returns ``[T, num_heads, v_head_dim]``. Query heads
    share kv heads in consecutive groups (GQA). Keys and values are read back from the
    pages, so what attention sees is exactly what later steps will see.

    ``sinks`` (gpt-oss: one learned logit per query head, ``[num_heads]``) joins every
    softmax as an extra key with no value: it takes probability mass, then is dropped.
    """
    table = batch.block_table(cache.group)
    check_cache(cache, table)
    block_size = table.block_size
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    group_size = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads, v.shape[-1])

    for r, (start, end, computed) in enumerate(batch.query_ranges()):
        if start == end:
            continue
        row = table.block_ids[r]
        new_pos = batch.positions[start:end]
        new_slots = page_index(row, block_size, new_pos)
        store_kv(cache, new_slots, k[start:end], v[start:end])

        first_key = 0 if sliding_window is None else max(0, computed - sliding_window + 1)
        key_pos = torch.arange(first_key, computed + (end - start), device=new_pos.device)
        key_slots = page_index(row, block_size, key_pos)
        keys, values = load_kv(cache, key_slots, q.dtype)  # [K, Hkv, D]

        # [Hkv, G, Q, D] x [Hkv, D, K] -> [Hkv, G, Q, K]
        queries = q[start:end].view(end - start, num_kv_heads, group_size, -1).permute(1, 2, 0, 3)
        scores = torch.matmul(queries, keys.permute(1, 2, 0).unsqueeze(1)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        visible = key_pos[None, :] <= new_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > new_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            sink = sinks.to(scores.dtype).view(num_kv_heads, group_size, 1, 1)
            with_sink = torch.cat((scores, sink.expand(-1, -1, scores.shape[2], 1)), dim=-1)
            with_sink = with_sink - with_sink.amax(dim=-1, keepdim=True)
            probs = torch.softmax(with_sink, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
        ctx = torch.matmul(probs, values.permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, Q, Dv]
        out[start:end] = ctx.permute(2, 0, 1, 3).reshape(end - start, num_heads, -1)
    return out


def check_cache(cache: KVCache, table: BlockTable) -> None:
    if cache.key.shape[1] != table.block_size:
        raise EngineError(
            f"attention group {cache.group!r}: cache pages hold {cache.key.shape[1]} tokens "
            f"but the block table says block_size {table.block_size}"
        )

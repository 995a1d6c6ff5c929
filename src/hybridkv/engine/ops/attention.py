"""Paged attention for a whole step in a few tensor ops (varlen: prefill and decode mixed).

Pages are ``[num_blocks, block_size, num_kv_heads, head_dim]``; token position ``p`` of
request ``r`` lives at ``(block_ids[r, p // block_size], p % block_size)``. Per step and
per (group, window), `AttentionIndex` is built once and shared by every layer of the
group: where the new tokens go, and per part (decode rows / prefill chunks, see
`varlen.split_by_length`) a padded query grid, the key positions each row reads and a
boolean mask. Example, block_size 4, window None, two rows::

    row 0: c = 5, n = 1    keys 0..5   -> key grid [0 1 2 3 4 5]      queries [5]
    row 1: c = 0, n = 3    keys 0..2   -> key grid [0 1 2 2 2 2]      queries [0 1 2]
           (cells past a row's keys repeat its last key, masked out: never the null block)
    mask row 1:  q0 [1 0 0 0 0 0]  q1 [1 1 0 0 0 0]  q2 [1 1 1 0 0 0]

Without a window the keys are loaded by whole blocks (a row's last block repeated past
its end; the cells past its last key zeroed after the load, `AttentionPart`): one page
copy per block instead of one per token, the same values in every cell the mask lets
through. A sliding window W lets position p see keys in (p - W, p]; a row reads keys
from ``max(0, c - W + 1)`` on (not block-aligned: loaded by (block, offset)), so blocks
wholly before that may be the null block (id 0).
Without softcap or sinks the grid goes to `scaled_dot_product_attention` (GQA via
``enable_gqa``); Gemma's softcap and gpt-oss's sinks take an explicit matmul path.
`attention_reference` is the per-request oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.engine.ops.attention_reference import check_cache
from hybridkv.engine.ops.context import ForwardBatch, KVCache
from hybridkv.engine.ops.kv_io import PageIndex, load_kv, load_kv_blocks, store_kv
from hybridkv.engine.ops.tree_batch import apply_tree_mask
from hybridkv.engine.ops.varlen import Padded, padded_for, split_by_length
from hybridkv.errors import EngineError

# Rows with at most this many new tokens share one part (decode and verify steps).
SHORT_MAX_TOKENS = 8


@dataclass(frozen=True)
class AttentionPart:
    layout: Padded  # the part's queries as [R, Lq]
    keys: PageIndex  # [R, Kmax] each
    mask: torch.Tensor  # [R, 1, Lq, Kmax], bool: query may see key
    # Without a window every row's keys start at position 0, block-aligned: the key grid
    # is then whole blocks ``key_blocks [R, ceil(Kmax / block_size)]`` (a row's last
    # block repeated past its end) cut to Kmax, and ``pad_keys`` (rows, keys) are the
    # cells past each row's last key, zeroed after the load (stale page contents, NaN
    # in an fp8 page, never reach the softmax). None: load by (block, offset).
    key_blocks: torch.Tensor | None = None
    pad_keys: PageIndex | None = None


@dataclass(frozen=True)
class AttentionIndex:
    """One step's page indices for one (group, window): new-token slots and parts."""

    new_slots: PageIndex  # [T] each: where each new token's K/V goes
    parts: tuple[AttentionPart, ...]


def attention_index(batch: ForwardBatch, group: str, window: int | None) -> AttentionIndex:
    """Built on the first layer of ``group`` in a step, reused by the others."""
    return batch.memoized(("attention", group, window), lambda: _build(batch, group, window))


def _build(batch: ForwardBatch, group: str, window: int | None) -> AttentionIndex:
    table = batch.block_table(group)
    block_size = table.block_size
    device = batch.input_ids.device
    lengths, computed = batch.host_lengths, batch.host_computed
    width = int(table.block_ids.shape[1])
    for r, (n, c) in enumerate(zip(lengths, computed, strict=True)):
        if n and (c + n - 1) // block_size >= width:
            raise EngineError(
                f"attention group {group!r}, request {r}: position {c + n - 1} needs logical "
                f"block {(c + n - 1) // block_size} but the block table has {width} columns "
                f"(block_size {block_size})"
            )
    ids = table.block_ids.long()
    rows_of_tokens = torch.repeat_interleave(
        torch.arange(batch.num_reqs, device=device),
        torch.tensor(lengths, dtype=torch.long).to(device),
    )
    pos = batch.positions
    new_slots = (ids[rows_of_tokens, pos // block_size], pos % block_size)
    parts = []
    for reqs in split_by_length(lengths, SHORT_MAX_TOKENS):
        layout = padded_for(batch, reqs)
        first = [0 if window is None else max(0, computed[r] - window + 1) for r in reqs]
        ends = [computed[r] + lengths[r] for r in reqs]  # one past the last key
        num_keys = max(e - f for f, e in zip(first, ends, strict=True))
        first_t = torch.tensor(first, dtype=torch.long).to(device)
        last_t = torch.tensor(ends, dtype=torch.long).to(device) - 1
        key_pos = first_t[:, None] + torch.arange(num_keys, device=device)[None, :]
        key_ok = key_pos <= last_t[:, None]
        key_pos = torch.minimum(key_pos, last_t[:, None])  # pad cells re-read the last key
        row_ids = ids[torch.tensor(reqs, dtype=torch.long).to(device)]
        blocks = torch.gather(row_ids, 1, key_pos // block_size)
        starts = torch.tensor([computed[r] for r in reqs], dtype=torch.long).to(device)
        q_pos = starts[:, None] + torch.arange(layout.max_len, device=device)[None, :]
        mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & key_ok[:, None, :]
        if window is not None:
            mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
        # Padding queries see their row's first key, so no softmax row is all -inf.
        mask[:, :, 0] |= ~layout.valid
        key_blocks = pad_keys = None
        if window is None:  # first = 0 for every row: whole blocks (see `AttentionPart`)
            columns = torch.arange(-(-num_keys // block_size), device=device)[None, :]
            key_blocks = torch.gather(
                row_ids, 1, torch.minimum(columns, last_t[:, None] // block_size)
            )
            pad_rows, pad_cols = (~key_ok).nonzero(as_tuple=True)
            pad_keys = (pad_rows, pad_cols)
        parts.append(
            AttentionPart(
                layout, (blocks, key_pos % block_size), mask[:, None], key_blocks, pad_keys
            )
        )
    index = AttentionIndex(new_slots=new_slots, parts=tuple(parts))
    if batch.tree is not None:  # token trees: ancestors only (`tree_batch`)
        apply_tree_mask(index, batch, window)
    return index


def paged_attention(
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
    """Store ``k``/``v`` of the new tokens in ``cache``, then causal attention of every
    request over its pages.

    ``q`` is ``[T, num_heads, head_dim]``, ``k`` ``[T, num_kv_heads, head_dim]`` and ``v``
    ``[T, num_kv_heads, v_head_dim]``; returns ``[T, num_heads, v_head_dim]``. Query heads
    share kv heads in consecutive groups (GQA). Keys and values are read back from the
    pages, so what attention sees is exactly what later steps will see. ``sinks``
    (gpt-oss, ``[num_heads]``) join every softmax as a key with no value.
    """
    check_cache(cache, batch.block_table(cache.group))
    index = attention_index(batch, cache.group, sliding_window)
    store_kv(cache, index.new_slots, k, v)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for part in index.parts:
        queries = part.layout.pad(q).transpose(1, 2)  # [R, H, Lq, D]
        if part.key_blocks is not None and part.pad_keys is not None:
            num_keys = int(part.mask.shape[-1])
            keys, values = load_kv_blocks(
                cache, part.key_blocks, num_keys, part.pad_keys, q.dtype, batch.scratch
            )
        else:
            keys, values = load_kv(cache, part.keys, q.dtype)  # [R, K, Hkv, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [R, Hkv, K, D]
        if softcap is None and sinks is None and _grouped_pays(queries, keys):
            ctx = _grouped_sdpa(queries, keys, values, part.mask, scale)
        elif softcap is None and sinks is None:
            ctx = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=part.mask, scale=scale, enable_gqa=True
            )
        else:
            ctx = _matmul_attention(queries, keys, values, part.mask, scale, softcap, sinks)
        part.layout.unpad_into(out, ctx.transpose(1, 2))
    return out


def _grouped_pays(queries: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether to fold a short part's query heads into query rows (`_grouped_sdpa`):
    bf16 / fp16 on a CPU with GQA. There torch's flash kernel took 9.0 ms for a decode
    step's ``[32, 8, 1, 64]`` queries over ``[32, 2, 320, 64]`` keys and 1.5 ms folded
    (one thread, bf16); float32 gains nothing (2.0 ms both) and keeps the plain call, so
    the float32 values the exactness tests check do not change. Folding sums in another
    order: not bit-identical in bf16 (tests/engine/test_grouped_attention.py bounds it)."""
    return (
        queries.dtype in (torch.bfloat16, torch.float16)
        and queries.device.type == "cpu"
        and queries.shape[2] <= SHORT_MAX_TOKENS
        and queries.shape[1] != keys.shape[1]
    )


def _grouped_sdpa(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """GQA attention with the ``G`` query heads of each kv head as ``G * Lq`` query rows of
    that head: ``[R, H, Lq, D]`` -> ``[R, Hkv, G * Lq, D]``, the mask repeated per head."""
    rows, heads, length, dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    folded = queries.reshape(rows, kv_heads, group * length, dim)
    rows_mask = mask[:, :, None].expand(rows, 1, group, length, num_keys)
    ctx = F.scaled_dot_product_attention(
        folded,
        keys,
        values,
        attn_mask=rows_mask.reshape(rows, 1, group * length, num_keys),
        scale=scale,
    )
    return ctx.view(rows, heads, length, -1)


def _matmul_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Scores materialised: ``[R, Hkv, G, Lq, K]``, softcap and sinks as the reference."""
    rows, heads, length, _ = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    grouped = queries.view(rows, kv_heads, group, length, -1)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)[:, :, None]) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    else:
        sink = sinks.to(scores.dtype).view(1, kv_heads, group, 1, 1)
        with_sink = torch.cat((scores, sink.expand(rows, -1, -1, length, 1)), dim=-1)
        with_sink = with_sink - with_sink.amax(dim=-1, keepdim=True)
        probs = torch.softmax(with_sink, dim=-1, dtype=torch.float32)[..., :-1]
        probs = probs.to(queries.dtype)
    ctx = torch.matmul(probs, values[:, :, None])  # [R, Hkv, G, Lq, Dv]
    return ctx.reshape(rows, heads, length, -1)

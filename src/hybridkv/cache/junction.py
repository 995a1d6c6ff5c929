"""Junction partial hits: a prefix hit that ends inside an attention block, served by
a *copy* of the cached block's first slots (copy-on-write; part of the ``junction``
checkpoint rule together with ``turn_end``, see `CacheManager`).

A prompt that leaves the cached prefix inside a block (a system prompt ending
mid-block) used to hit only up to the block boundary below. With this rule:

* every token-indexed group keeps a bounded index *parent chain hash -> cached child
  blocks with their tokens* (`ChildIndex`, per pool, kept consistent with eviction
  through `BlockPool._unindex`); the parent of a first block is the chain's root
  (`hashing.chain_hash_at`: cache salt, LoRA id), so a system prompt shorter than a
  block is served too, and never across tenants;
* at lookup, after the full-block match stops at ``a = k * B``, the child of the chain
  hash at ``a`` whose tokens share the longest common prefix with the prompt's next
  block extends the hit to ``j`` (``a < j < a + B``) -- only if every state group also
  has a state at exactly ``j`` (the coordinator's fixed point settles that; the
  junction rule stores it, keyed like a turn-end entry, when a request leaves the
  cached prefix at ``j``);
* the hit request gets a fresh block at position ``k`` and the step's `StepDelta` holds
  a `CopyOrder` (source, destination, ``j - a`` slots) per token-indexed group; the
  engine copies those K/V slots before it runs the step. The source is referenced
  (pinned) from admission until the request's first commit, so it cannot be evicted or
  reused before the copy has run.

Example, B = 8; request A computed 20 tokens (blocks [0,8) [8,16) cached, children of
the hash at 8 include A's block [8,16) with its tokens); request C shares 13 tokens::

    full-block match: 8; child of hash(8) with the longest common prefix: A's block,
    13 - 8 = 5 tokens -> hit 13 (if the states have 13), copy 5 slots into a fresh block

Groups keyed one token ahead (EAGLE / MTP head groups) are not served: a child's slots
depend on the token after them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

# `CopyOrder` lives in `cache.delta`, the indexes with the pool (`cache.indexes`);
# their names stay importable here
from hybridkv.cache.delta import CopyOrder as CopyOrder
from hybridkv.cache.hashing import chain_hash_at
from hybridkv.cache.indexes import MAX_CHILDREN_PER_PARENT as MAX_CHILDREN_PER_PARENT
from hybridkv.cache.indexes import ChildIndex as ChildIndex
from hybridkv.ids import BlockId

if TYPE_CHECKING:
    from hybridkv.cache.block_pool import BlockPool
    from hybridkv.cache.managers.base import GroupManager

# `ChildIndex.memo` starts afresh past this many payloads (one prompt span met that
# many distinct children: under one parent, groups and passes, at most 8 per group)
_MEMO_PAYLOADS: Final = 256


def token_bytes(tokens: Sequence[int], start: int, end: int) -> bytes:
    """``tokens[start:end]`` as bytes, 8 per token (a child's payload, a prompt span)."""
    span = tokens[start:end]
    return (span if isinstance(span, array) else array("q", span)).tobytes()


# `span_bytes` kinds: a bare span (a junction payload or prompt span); a turn-end key
# (`turn_end._key`), keyed ahead or not
SPAN: Final = -1


def span_bytes(pool: BlockPool, tokens: Sequence[int], start: int, end: int) -> bytes:
    """`token_bytes`, shared through ``pool.spans`` while the coordinator serves one
    request's call (``tokens`` is then that request's, unchanged during the call), so
    that the groups asking for one span build it once."""
    spans = pool.spans
    if spans is None:
        return token_bytes(tokens, start, end)
    out = spans.get((start, end, SPAN))
    if out is None:
        out = spans[(start, end, SPAN)] = token_bytes(tokens, start, end)
    return out


def note_children(
    manager: GroupManager,
    blocks: Sequence[BlockId],
    first: int,
    last: int,
    hashes: Sequence[bytes],
    root: bytes,
    tokens: Sequence[int],
    fresh: bool = False,
) -> None:
    """Index ``blocks[j]``, j in ``[first, last)``, that this commit cached (block ``j``
    under the chain hash at ``j * B``: the root for the first block), in one loop (a
    prefill chunk indexes every block it filled). ``fresh``: `BlockPool.cache_table`
    just stored every one of them (so each is cached under its chain hash and not
    indexed yet)."""
    children = manager.pool.children
    if children is None or manager.key_ahead:
        return
    lo = first
    if lo >= last:
        return
    B = manager.block_size
    step = B // manager.unit_tokens
    own, group = manager.pool.hashes, manager.group_id
    only, many = children.maps(group)
    parent_of, payload_of = children.parent_of, children.payload_of
    # One group: the chunk's tokens as bytes once, each payload one slice of them.
    # Several (a coordinator call with `BlockPool.spans` open): each payload once, the
    # same bytes object for every group (hybrid blocks hold KBs of tokens, and a copy
    # per group costs memory and cache misses at every later comparison)
    spans = manager.pool.spans
    data = token_bytes(tokens, lo * B, last * B) if spans is None else b""
    width = 8 * B
    added = 0
    for j in range(lo, last):
        block = blocks[j]
        if fresh or (own.get(block) == hashes[(j + 1) * step - 1] and parent_of[block] is None):
            if spans is None:
                offset = (j - lo) * width
                payload = data[offset : offset + width]
            else:
                payload = span_bytes(manager.pool, tokens, j * B, (j + 1) * B)
            parent = hashes[j * step - 1] if j else root
            if parent in only or parent in many:  # siblings: a junction
                children.link(only, many, parent, block, payload)
            else:  # `ChildIndex.link`'s common case inline: a new parent's only child
                only[parent] = block
                parent_of[block] = parent
                payload_of[block] = payload
                added += 1
    children.num_children += added


def _common_prefix(a: bytes, b: bytes, hint: int = 0) -> int:
    """Length in tokens (8 bytes each) of the common prefix of two payloads. ``hint``:
    a likely answer, checked first with two compares (a parent's children often share
    one prefix with the prompt: the rest of a family's system prompt)."""
    top = min(len(a), len(b)) // 8
    if 0 < hint <= top:
        cut = 8 * hint
        if a[:cut] == b[:cut] and (hint == top or a[cut : cut + 8] != b[cut : cut + 8]):
            return hint
    # Gallop (1, 2, 4, ... tokens), then bisect: most children share a few tokens or
    # none with the prompt, and a short compare is cheap where a long slice copies
    lo, hi = 0, 1
    while hi <= top and a[: 8 * hi] == b[: 8 * hi]:
        lo, hi = hi, 2 * hi
    hi = min(hi - 1, top)
    while lo < hi:  # largest n in [lo, hi] with a[:8n] == b[:8n] (a[:8 lo] matches)
        mid = (lo + hi + 1) // 2
        if a[8 * lo : 8 * mid] == b[8 * lo : 8 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_partial(
    manager: GroupManager,
    hashes: Sequence[bytes],
    root: bytes,
    tokens: Sequence[int],
    anchor: int,
    limit: int,
) -> tuple[int, BlockId] | None:
    """The cached child of the chain hash at block boundary ``anchor`` (``root`` at 0)
    sharing the longest common prefix with ``tokens[anchor:limit]`` (capped at one
    block): (anchor + that length, block), or None when no child shares a token."""
    children = manager.pool.children
    if children is None or manager.key_ahead:
        return None
    parent = chain_hash_at(hashes, root, manager.unit_tokens, anchor)
    if parent is None:
        return None
    entries = children.children_of(manager.group_id, parent)
    if not entries:
        return None
    payload_of = children.payload_of
    span_end = min(anchor + manager.block_size - 1, len(tokens) - 1)
    room = min(limit, span_end) - anchor  # the hit may reach at most anchor + room
    if room <= 0:
        return None
    # The common prefix of the span up to ``limit`` with a payload is that of the whole
    # span, capped at ``room``: the memo holds the whole span's (shared by every limit)
    want = span_bytes(manager.pool, tokens, anchor, span_end)
    memo = children.memo
    if want != children.memo_want or len(memo) > _MEMO_PAYLOADS:
        children.memo_want = want
        memo = children.memo = {}
    best: tuple[int, BlockId] | None = None
    hint = 0  # the last child's common prefix: siblings often share it
    for block in entries:
        payload = payload_of[block]
        length = memo.get(payload)
        if length is None:
            length = memo[payload] = hint = _common_prefix(want, payload, hint)
        if length > room:
            length = room
        if length and (best is None or anchor + length > best[0]):
            best = (anchor + length, block)
    return best


def is_copy_source(manager: GroupManager, block: BlockId) -> bool:
    """A hit's partial block is a junction copy source (not a turn-end entry, which the
    request takes over instead)."""
    children = manager.pool.children
    return children is not None and children.parent_of[block] is not None


def junction_copies(
    managers: Sequence[GroupManager], states: Sequence[Any]
) -> tuple[CopyOrder, ...]:
    """The copy orders of an admission just allocated (one per token-indexed group
    whose hit ends with a junction copy)."""
    out = []
    for manager, state in zip(managers, states, strict=True):
        order = manager.copy_order(state)
        if order is not None:
            out.append(CopyOrder(manager.group_id, *order))
    return tuple(out)

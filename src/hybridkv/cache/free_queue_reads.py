"""Read-only views of a `FreeQueue` (ids per tier) and its invariant check; split from
`cache.free_queue` so that each file stays readable."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from hybridkv.errors import InvariantError

try:  # mypyc's class options (setup.py's compiled build); a no-op without mypy installed
    from mypy_extensions import mypyc_attr
except ImportError:  # pragma: no cover - the pure-Python install without the dev extra

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Any:  # type: ignore[misc]
        return lambda cls: cls


if TYPE_CHECKING:
    from hybridkv.cache.loop_detect import LoopDetector

# Tier indexes (``lru`` uses only PROBATION).
DEAD: Final = 0
PROBATION: Final = 1
PROTECTED: Final = 2
TIER_NAMES = ("dead", "probation", "protected")
_NUM_TIERS: Final = 3


# the simulator's Belady queue extends `FreeQueue` (`sim.belady`): the compiled build
# must allow interpreted subclasses of it and of its bases
@mypyc_attr(allow_interpreted_subclasses=True)
class FreeQueueReads:
    """Queries over the links a `FreeQueue` keeps (attributes set by its __init__)."""

    _chain: bool
    _num_blocks: int
    _next: list[int]
    _prev: list[int]
    _tier: list[int]
    _tier_len: list[int]
    _freed_at: list[int]
    _num_cached: int
    _fresh: list[int]
    loops: LoopDetector

    def fresh_ids(self) -> list[int]:
        return list(self._fresh)

    def tier_ids(self, tier: int) -> list[int]:
        """Cached free blocks of one tier, oldest (LRU end) first."""
        out = []
        sentinel = self._num_blocks + tier
        node = self._next[sentinel]
        while node != sentinel:
            out.append(node)
            node = self._next[node]
        return out

    def cached_ids(self) -> list[int]:
        """Every cached free block, tier by tier in eviction order of the tiers."""
        return [b for tier in range(_NUM_TIERS) for b in self.tier_ids(tier)]

    def _check_bursts(self, tier: int, ids: list[int]) -> None:
        """chain: the blocks of one burst (one release time) are contiguous in their
        tier, which eviction's walk to the oldest burst's tail relies on."""
        done: set[int] = set()
        last = -1
        for block in ids:
            freed_at = self._freed_at[block]
            if freed_at != last:
                if freed_at in done:
                    raise InvariantError(
                        f"free queue tier {TIER_NAMES[tier]}: the burst released at "
                        f"{freed_at} is split (block {block} is apart from the rest)"
                    )
                done.add(freed_at)
                last = freed_at

    def check_invariants(self) -> None:
        """Links are symmetric, tier marks and counts agree, no block twice."""
        seen: set[int] = set()
        for tier in range(_NUM_TIERS):
            ids = self.tier_ids(tier)
            if len(ids) != self._tier_len[tier]:
                raise InvariantError(
                    f"free queue tier {TIER_NAMES[tier]}: {len(ids)} linked blocks, "
                    f"count says {self._tier_len[tier]}"
                )
            for block in ids:
                if self._tier[block] != tier or block in seen:
                    raise InvariantError(
                        f"free queue: block {block} linked in tier {TIER_NAMES[tier]} but "
                        f"marked {self._tier[block]} (or linked twice)"
                    )
                if self._prev[self._next[block]] != block:
                    raise InvariantError(f"free queue: broken links around block {block}")
                seen.add(block)
            if not self._chain and tier != PROBATION and ids:
                raise InvariantError(f"lru free queue uses tier {TIER_NAMES[tier]}")
            if self._chain and tier != DEAD:
                self._check_bursts(tier, ids)
        if len(seen) != self._num_cached:
            raise InvariantError(
                f"free queue: {len(seen)} cached blocks linked, count says {self._num_cached}"
            )
        marked = sum(1 for t in self._tier if t >= 0)
        if marked != self._num_cached:
            raise InvariantError(
                f"free queue: {marked} blocks marked cached-free, count says {self._num_cached}"
            )
        if seen & set(self._fresh):
            raise InvariantError("free queue: a block is both fresh and cached")
        self.loops.check_invariants(seen, chain=self._chain)

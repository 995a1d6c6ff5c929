"""A prefix-aware router's index of one vLLM engine running hybridkv's scheduler, rebuilt
from the engine's KV-cache events alone (what docs/vllm_scheduler.md says a router may
assume), predicting the prefix hit the engine will report for a prompt.

It knows vLLM's hashing only through two functions: ``chain(prompt)`` (vLLM's chain
hashes of the prompt, raw bytes, one per hash unit) and ``tail(parent, tokens)`` (vLLM's
hash of one block of ``tokens`` after ``parent``), plus ``external`` (the published
form). Events are dicts as a msgpack subscriber decodes them (``{"type": ...}``).

Shared by tests/unit/test_vllm_events.py (stand-in hashing) and
tests/vllm_plugin/test_kv_events.py (vLLM's own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Entry:
    parent: Any  # published key of the prefix before it (None: the first block)
    tokens: tuple[int, ...]


@dataclass
class EventIndex:
    groups: list[dict[str, Any]]  # vLLM's get_kv_cache_group_metadata()
    hash_unit_tokens: int
    chain: Callable[[Sequence[int]], list[bytes]]
    tail: Callable[[bytes | None, Sequence[int]], bytes]
    external: Callable[[bytes], Any]
    entries: dict[int, dict[Any, Entry]] = field(default_factory=dict)
    num_events: int = 0

    def __post_init__(self) -> None:
        for g in self.groups:
            if g["kind"] not in ("full_attention", "mamba"):
                raise NotImplementedError(f"group kind {g['kind']!r}")
            self.entries[g["group_idx"]] = {}

    # ------------------------------------------------------------------ events
    def apply(self, event: dict[str, Any]) -> None:
        self.num_events += 1
        kind = event["type"]
        if kind == "AllBlocksCleared":
            for entries in self.entries.values():
                entries.clear()
            return
        entries = self.entries[event["group_idx"]]
        if kind == "BlockRemoved":
            for key in event["block_hashes"]:
                del entries[key]  # a removal names a key announced before (KeyError: not)
            return
        assert kind == "BlockStored", kind
        size, keys, tokens = event["block_size"], event["block_hashes"], event["token_ids"]
        assert len(tokens) == len(keys) * size, event
        parent = event["parent_block_hash"]
        for i, key in enumerate(keys):
            assert key not in entries, ("announced twice", event)
            entries[key] = Entry(parent, tuple(tokens[i * size : (i + 1) * size]))
            parent = key

    # ------------------------------------------------------------------ hits
    def predict(self, prompt: Sequence[int]) -> int:
        """The longest prefix (<= len - 1 tokens) every group holds: the engine's hit."""
        raw = self.chain(prompt)
        keys = [self.external(h) for h in raw]
        limit = len(prompt) - 1
        groups = self.groups
        agreed = g = 0
        while agreed < len(groups) and limit > 0:
            new_limit = self._group_hit(groups[g], prompt, raw, keys, limit)
            if new_limit < limit:
                limit, agreed = new_limit, 1
            else:
                agreed += 1
            g = (g + 1) % len(groups)
        return max(limit, 0)

    def _key_at(self, keys: list[Any], pos: int) -> Any:
        return None if pos == 0 else keys[pos // self.hash_unit_tokens - 1]

    def _tail_end(
        self,
        entries: dict[Any, Entry],
        prompt: Sequence[int],
        raw: list[bytes],
        keys: list[Any],
        lo: int,
        hi: int,
    ) -> int:
        """The longest stored partial entry ending in ``(lo, hi]`` that the prompt
        reaches (its key recomputed from the prompt, as vLLM hashes): its end, or 0."""
        unit = self.hash_unit_tokens
        best = 0
        for key, entry in entries.items():
            size = len(entry.tokens)
            parent_pos = None
            for p in range(lo // unit * unit, min(hi, len(keys) * unit) + 1, unit):
                if self._key_at(keys, p) == entry.parent:  # where its parent sits
                    parent_pos = p
                    break
            if parent_pos is None:
                continue
            end = parent_pos + size
            if not lo < end <= hi or end <= best:
                continue
            if end % unit == 0:
                want = keys[end // unit - 1] if end // unit <= len(keys) else None
            else:
                parent_raw = None if parent_pos == 0 else raw[parent_pos // unit - 1]
                want = self.external(self.tail(parent_raw, prompt[parent_pos:end]))
            if want == key:
                best = end
        return best

    def _group_hit(
        self,
        group: dict[str, Any],
        prompt: Sequence[int],
        raw: list[bytes],
        keys: list[Any],
        limit: int,
    ) -> int:
        entries = self.entries[group["group_idx"]]
        size = group["block_size"]

        def top_of(anchor: int) -> int:  # an entry ends inside the block after its anchor
            return min(limit, len(prompt) - 1, anchor + size - 1)

        if group["kind"] == "mamba":  # a state: exactly where an entry ends
            pos = limit // size * size
            while True:
                if pos < limit:
                    end = self._tail_end(entries, prompt, raw, keys, pos, top_of(pos))
                    if end:
                        return end
                if pos <= 0:
                    return 0
                if self._key_at(keys, pos) in entries:
                    return pos
                pos -= size
        num = 0  # full attention: blocks from the start, then into the next block
        while (num + 1) * size <= limit and self._key_at(keys, (num + 1) * size) in entries:
            num += 1
        anchor = num * size
        if anchor >= limit:
            return anchor
        best = max(anchor, self._tail_end(entries, prompt, raw, keys, anchor, top_of(anchor)))
        # a junction copy: the first tokens of a stored block after the same prefix
        parent = self._key_at(keys, anchor)
        room = top_of(anchor) - anchor
        for entry in entries.values():
            if entry.parent != parent or len(entry.tokens) != size:
                continue
            common = 0
            while common < room and entry.tokens[common] == prompt[anchor + common]:
                common += 1
            best = max(best, anchor + common)
        return best

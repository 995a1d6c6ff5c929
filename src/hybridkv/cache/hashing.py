"""Chained block hashes of verified tokens, deterministic across processes.

The chain runs at a *unit* of ``unit_tokens`` tokens: the greatest common divisor of the
block sizes of every group, so every group's block boundaries fall on unit boundaries
and one chain serves all groups::

    tokens   |t0 .. t3|t4 .. t7|t8 .. t11|t12 ..        unit = 4
    chain     h1       h2       h3                         h_i = H(h_{i-1} | tokens of unit i)
    h0 = H(domain | cache_salt | lora_id)                  extra keys enter once, at the root

    attention group, block 8: block j ends at 8(j+1) -> key h_{2(j+1)}
    state group, interval 12: checkpoint after 12 tokens -> key h3

Because ``h_i`` digests the whole prefix (and the extra keys), the key of a block names
its full context; with sha256 (the default) a hit is collision safe. With ``xxhash``
(xxh3-128, faster, not collision resistant) the pool also stores each cached block's
own tokens and a hit compares them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from hybridkv.errors import CacheError

HASH_ALGOS = ("sha256", "xxhash")
_DOMAIN = b"hybridkv-block-hash-v1"


class BlockHasher:
    """Computes chain hashes for one plan (fixed unit and algorithm)."""

    def __init__(self, algo: str, unit_tokens: int) -> None:
        if algo not in HASH_ALGOS:
            raise CacheError(f"hash_algo must be one of {HASH_ALGOS}, got {algo!r}")
        assert unit_tokens > 0
        self.algo = algo
        self.unit_tokens = unit_tokens
        self.collision_safe = algo == "sha256"
        if algo == "sha256":
            self._digest = _sha256
        else:
            import xxhash

            self._digest = xxhash.xxh3_128_digest

    def root(self, cache_salt: str | None, lora_id: int | None) -> bytes:
        extra = repr((cache_salt, lora_id)).encode()
        return self._digest(_DOMAIN + len(extra).to_bytes(4, "little") + extra)

    def extend(self, hashes: list[bytes], root: bytes, tokens: Sequence[int], upto: int) -> None:
        """Append chain hashes for every full unit of ``tokens[:upto]`` not hashed yet."""
        unit = self.unit_tokens
        begin, end = len(hashes) * unit, min(upto, len(tokens)) // unit * unit
        if begin >= end:
            return
        parent = hashes[-1] if hashes else root
        payload = array("q", tokens[begin:end]).tobytes()
        digest, unit_bytes = self._digest, unit * 8
        for start in range(0, len(payload), unit_bytes):
            parent = digest(parent + payload[start : start + unit_bytes])
            hashes.append(parent)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()

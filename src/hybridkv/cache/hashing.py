"""Chained block hashes of verified tokens, deterministic across processes.

The chain runs at a *unit* of ``unit_tokens`` tokens: the greatest common divisor of the
block sizes of every group, so every group's block boundaries fall on unit boundaries
and one chain serves all groups::

    tokens   |t0 .. t3|t4 .. t7|t8 .. t11|t12 ..        unit = 4
    chain     h1       h2       h3                         h_i = H(h_{i-1} | tokens of unit i)
    h0 = H(domain | cache_salt | lora_id)                  extra keys enter once, at the root

    attention group, block 8: block j ends at 8(j+1) -> key h_{2(j+1)}
    state group, interval 12: checkpoint after 12 tokens -> key h3

The chain hash *at* a unit boundary ``p`` names the prefix ``tokens[:p]``
(`chain_hash_at`): ``h_{p / unit}``, and the root ``h0`` at ``p = 0`` -- what a block
starting at ``p`` is chained to (junction children, turn-end entries anchor there).

Because ``h_i`` digests the whole prefix (and the extra keys), the key of a block names
its full context; sha256 is collision resistant, so equal keys mean equal prefixes,
cache salts and LoRA ids, and a hit needs no token comparison. A faster non-
cryptographic hash (xxh3) was offered before; it is refused now: a forced collision
would let one tenant hit another's blocks unless every hit re-verified the whole chain,
which costs more than the hash saves (sha256 of a 16-token unit: about 0.45 us).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import sha256
from typing import Final

from hybridkv.errors import CacheError

HASH_ALGOS = ("sha256",)
_DOMAIN = b"hybridkv-block-hash-v1"
MAX_TOKEN_ID: Final = (1 << 63) - 1  # tokens are hashed as signed 64-bit integers
_EMPTY_SHA256 = sha256()  # never updated: copied for each unit (see `BlockHasher.extend`)


def chain_hash_at(
    hashes: Sequence[bytes], root: bytes, unit_tokens: int, num_tokens: int
) -> bytes | None:
    """The chain hash naming ``tokens[:num_tokens]`` (a multiple of ``unit_tokens``):
    ``root`` at 0 (the extra keys that key the first block: cache salt, LoRA id), None
    when that unit is not hashed yet."""
    if num_tokens == 0:
        return root
    if num_tokens < 0 or num_tokens // unit_tokens > len(hashes):
        return None
    return hashes[num_tokens // unit_tokens - 1]


class BlockHasher:
    """Computes chain hashes for one plan (fixed unit and algorithm)."""

    def __init__(self, algo: str, unit_tokens: int) -> None:
        if algo not in HASH_ALGOS:
            why = (
                " (xxhash was dropped: not collision resistant, so a forced collision "
                "could cross cache salts and prefixes)"
                if algo == "xxhash"
                else ""
            )
            raise CacheError(f"hash_algo must be one of {HASH_ALGOS}, got {algo!r}{why}")
        assert unit_tokens > 0
        self.algo = algo
        self.unit_tokens = unit_tokens

    def root(self, cache_salt: str | None, lora_id: int | None) -> bytes:
        extra = repr((cache_salt, lora_id)).encode()
        return sha256(_DOMAIN + len(extra).to_bytes(4, "little") + extra).digest()

    def extend(self, hashes: list[bytes], root: bytes, tokens: Sequence[int], upto: int) -> None:
        """Append chain hashes for every full unit of ``tokens[:upto]`` not hashed yet."""
        unit = self.unit_tokens
        begin, end = len(hashes) * unit, min(upto, len(tokens)) // unit * unit
        if begin >= end:
            return
        parent = hashes[-1] if hashes else root
        chunk = tokens[begin:end]
        if end - begin == unit and isinstance(chunk, array):  # one unit: a decode step's
            h = _EMPTY_SHA256.copy()  # block; the loop below, once, on the array's bytes
            h.update(parent)
            h.update(chunk)
            hashes.append(h.digest())
            return
        payload = (chunk if isinstance(chunk, array) else array("q", chunk)).tobytes()
        unit_bytes = unit * 8
        append = hashes.append
        # Copying an empty context skips the digest lookup a new sha256() does (about
        # 15% of a 16-token unit's hash); same digests.
        fresh = _EMPTY_SHA256.copy
        for start in range(0, len(payload), unit_bytes):
            h = fresh()
            h.update(parent + payload[start : start + unit_bytes])
            parent = h.digest()
            append(parent)

"""Varlen <-> padded: some requests' new tokens laid out as a ``[R, L]`` grid.

Batched kernels (attention, recurrent scans, causal conv) run over a rectangle; the
step's tokens are a flat stream of requests of different lengths. A `Padded` layout is
the index arithmetic between the two, computed once per step and shared by every layer.
Example, stream ``[a0 a1 | b0 b1 b2 | c0]`` (T = 6), all three requests, L = 3::

    grid       row 0: a0 a1 __      gather = [0 1 6 | 2 3 4 | 5 6 6]   (6 = T: a zero row)
               row 1: b0 b1 b2      scatter = [0 1 3 4 5 6]            (grid cells of tokens)
               row 2: c0 __ __      tokens  = [0 1 2 3 4 5]            (their stream indices)

Padding cells read a zero row, so a kernel sees zeros there; what it writes there is
dropped by `unpad`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridkv.engine.ops.context import ForwardBatch


@dataclass(frozen=True)
class Padded:
    """Requests ``reqs`` (batch indices) of a step as a ``[R, max_len]`` grid."""

    reqs: tuple[int, ...]
    lengths: tuple[int, ...]  # new tokens per request, host side
    max_len: int
    lengths_t: torch.Tensor  # [R], int64
    gather: torch.Tensor  # [R * max_len], stream index per cell, num_tokens for padding
    scatter: torch.Tensor  # [N], grid cell of each of the requests' tokens
    tokens: torch.Tensor  # [N], stream index of each of them (same order as scatter)
    valid: torch.Tensor  # [R, max_len], bool: the cell holds a token
    identity: bool  # the grid is the stream itself (all requests, equal lengths)

    @classmethod
    def build(
        cls,
        starts: Sequence[int],
        lengths: Sequence[int],
        reqs: Sequence[int],
        num_tokens: int,
        device: torch.device,
    ) -> Padded:
        """``starts``/``lengths``: stream offset and new tokens of every request of the
        batch; ``reqs`` picks (in order) the ones laid out."""
        own = [int(lengths[r]) for r in reqs]
        width = max(own, default=0)
        gather: list[int] = []
        scatter: list[int] = []
        tokens: list[int] = []
        for row, r in enumerate(reqs):
            n, s = own[row], int(starts[r])
            gather.extend(range(s, s + n))
            gather.extend([num_tokens] * (width - n))
            scatter.extend(range(row * width, row * width + n))
            tokens.extend(range(s, s + n))
        lengths_t = torch.tensor(own, dtype=torch.long)
        valid = torch.arange(width)[None, :] < lengths_t[:, None]

        def dev(t: list[int]) -> torch.Tensor:
            return torch.tensor(t, dtype=torch.long).to(device)

        return cls(
            reqs=tuple(int(r) for r in reqs),
            lengths=tuple(own),
            max_len=width,
            lengths_t=lengths_t.to(device),
            gather=dev(gather),
            scatter=dev(scatter),
            tokens=dev(tokens),
            valid=valid.to(device),
            identity=tokens == gather == list(range(num_tokens)),
        )

    @property
    def num_rows(self) -> int:
        return len(self.reqs)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Stream ``[T, *rest]`` -> grid ``[R, L, *rest]`` (zeros in padding cells)."""
        if self.identity:
            return x.reshape(self.num_rows, self.max_len, *x.shape[1:])
        extended = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        # index_select: the same rows as ``extended[gather]``, without advanced indexing
        picked = extended.index_select(0, self.gather)
        return picked.view(self.num_rows, self.max_len, *x.shape[1:])

    def unpad_into(self, out: torch.Tensor, grid: torch.Tensor) -> None:
        """Write the token cells of ``grid [R, L, *rest]`` into stream ``out [T, *rest]``."""
        flat = grid.reshape(self.num_rows * self.max_len, *grid.shape[2:])
        if self.identity:
            out.copy_(flat)
            return
        # token indices are distinct: index_copy_ stores what ``out[tokens] = ...`` would
        out.index_copy_(0, self.tokens, flat.index_select(0, self.scatter).to(out.dtype))


def padded_for(batch: ForwardBatch, reqs: Sequence[int]) -> Padded:
    """`Padded.build` for requests ``reqs`` of ``batch``, built once per step: the state
    groups and attention groups of a step split the requests the same way, so they
    share one layout (and its index tensors) instead of building one each."""
    return batch.memoized(
        ("padded", tuple(reqs)),
        lambda: Padded.build(
            batch.host_starts, batch.host_lengths, reqs, batch.num_tokens, batch.input_ids.device
        ),
    )


def split_by_length(lengths: Sequence[int], short_max: int) -> list[list[int]]:
    """Batch indices with new tokens, split into short (<= ``short_max``: decode and
    verify steps) and long (prefill chunks), so a long prefill does not pad every decode
    row to its length. Empty parts are left out."""
    short = [r for r, n in enumerate(lengths) if 0 < n <= short_max]
    long = [r for r, n in enumerate(lengths) if n > short_max]
    return [part for part in (short, long) if part]

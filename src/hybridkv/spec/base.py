"""Base of the layer specs: kinds, the `LayerSpec` interface and argument checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridkv.errors import SpecError
from hybridkv.spec.dtypes import DType

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
MLA = "mla"
STATE = "state"
KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION, MLA, STATE)


def require_positive(owner: object, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise SpecError(f"{type(owner).__name__}.{name} must be a positive int, got {value!r}")


def divide_over_ranks(owner: object, name: str, value: int, tp: int) -> int:
    """Divide ``value`` heads/channels over ``tp`` ranks, or raise with both numbers."""
    if value % tp:
        raise SpecError(
            f"{type(owner).__name__}.{name}={value} is not divisible by tensor parallel size "
            f"{tp}; use a TP size that divides {value}"
        )
    return value // tp


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """Base of all layer specs. Subclasses set `kind` and implement `page_bytes`."""

    kind: ClassVar[str]
    family: ClassVar[str]
    grows_with_tokens: ClassVar[bool]

    def page_bytes(self, block_size: int, num_spec_tokens: int = 0) -> int:
        raise NotImplementedError

    def shard(self, tp: int) -> LayerSpec:
        raise NotImplementedError

    def with_dtypes(
        self, kv: DType | None = None, conv: DType | None = None, ssm: DType | None = None
    ) -> LayerSpec:
        raise NotImplementedError

    def describe(self) -> str:
        return self.family

    # -- blocks per request (the one formula; see `hybridkv.plan.peak`) ----------
    def first_live_block(self, num_computed_tokens: int, block_size: int) -> int:
        """First block-table position a step starting at ``num_computed_tokens`` may
        read; earlier positions hold the null block. 0 for kinds that keep everything."""
        return 0

    def blocks_needed(
        self,
        *,
        block_size: int,
        num_computed_tokens: int,
        num_new_tokens: int = 1,
        num_lookahead_tokens: int = 0,
        num_spec_states: int = 0,
        state_mode: str = "none",
        junction_tokens: int = 0,
        reads_checkpoint: bool | None = None,
    ) -> int:
        """Blocks one request holds in a group of this spec during one step: ``c =
        num_computed_tokens`` computed, ``n`` new and ``L`` lookahead slots reserved
        (``junction_tokens``, ``reads_checkpoint``: state kinds only, see there).

        Token-indexed kinds hold table positions ``[first_live_block(c), cdiv(c+n+L, B))``::

            B 4, c 9, n 1, L 2: positions 0..11 -> cdiv(12, 4) = 3 blocks (full attention)

        State kinds override this with their slot budget.
        """
        end = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        return -(-end // block_size) - self.first_live_block(num_computed_tokens, block_size)

    def blocks_period(self, block_size: int) -> tuple[int, int] | None:
        """``(from_c, period)`` when `blocks_needed` repeats with ``period`` in ``c`` for
        every ``c >= from_c``; None when it only grows (full attention, MLA)."""
        return None

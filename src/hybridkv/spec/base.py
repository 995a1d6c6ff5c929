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

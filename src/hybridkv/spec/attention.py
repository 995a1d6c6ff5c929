"""Attention-like specs: a page holds ``block_size`` tokens, so it grows with it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from hybridkv.spec.base import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    MLA,
    SLIDING_ATTENTION,
    LayerSpec,
    divide_over_ranks,
    require_positive,
)
from hybridkv.spec.dtypes import DType


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(LayerSpec):
    """Full (global) attention. Also gated attention (Qwen3-Next) and NoPE (Granite)."""

    kind: ClassVar[str] = FULL_ATTENTION
    family: ClassVar[str] = "attention"
    grows_with_tokens: ClassVar[bool] = True

    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BFLOAT16
    v_head_dim: int | None = None  # None: same as head_dim
    gated: bool = False  # output gate: weights only, no cache bytes
    use_rope: bool = True  # False for NoPE layers: same cache
    # gpt-oss attention sinks are weights, not cache, so they do not appear here.

    def __post_init__(self) -> None:
        require_positive(self, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if self.v_head_dim is not None:
            require_positive(self, v_head_dim=self.v_head_dim)

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.value_dim) * self.dtype.num_bytes

    def page_bytes(self, block_size: int, num_spec_tokens: int = 0) -> int:
        return block_size * self.bytes_per_token()

    def shard(self, tp: int) -> AttentionSpec:
        # KV heads fewer than ranks are replicated (one head per rank), as engines do.
        if tp > self.num_kv_heads and tp % self.num_kv_heads == 0:
            return dataclasses.replace(self, num_kv_heads=1)
        return dataclasses.replace(
            self, num_kv_heads=divide_over_ranks(self, "num_kv_heads", self.num_kv_heads, tp)
        )

    def with_dtypes(
        self, kv: DType | None = None, conv: DType | None = None, ssm: DType | None = None
    ) -> AttentionSpec:
        return self if kv is None else dataclasses.replace(self, dtype=kv)

    def describe(self) -> str:
        extra = (" gated" if self.gated else "") + ("" if self.use_rope else " nope")
        return f"attn{extra} kv{self.num_kv_heads}x{self.head_dim} {self.dtype}"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a request needs at most the window's blocks alive."""

    kind: ClassVar[str] = SLIDING_ATTENTION
    family: ClassVar[str] = "sliding_window"

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, sliding_window=self.sliding_window)

    def max_live_blocks(self, block_size: int, num_in_flight_tokens: int = 1) -> int:
        """Blocks a request can need alive at once, at the worst alignment (DESIGN 3).

        The first token of a step at ``c`` reads from ``c - (W - 1)``; with
        ``num_in_flight_tokens`` tokens in the step, positions ``c - (W - 1) ..
        c + in_flight - 1`` are live: a span of ``s = W - 1 + in_flight`` positions,
        which touches at most ``cdiv(s - 1, B) + 1`` blocks (start at a block's last
        position). Example: W=4, block 2, 1 in flight: s 4 -> cdiv(3, 2) + 1 = 3.
        """
        span = self.sliding_window - 1 + num_in_flight_tokens
        return -(-(span - 1) // block_size) + 1

    def first_live_block(self, num_computed_tokens: int, block_size: int) -> int:
        # The step's first token, at c, reads back to c - (W - 1).
        return max(0, num_computed_tokens - (self.sliding_window - 1)) // block_size

    def blocks_period(self, block_size: int) -> tuple[int, int] | None:
        # Once the window has filled, c + B shifts both table ends by one block.
        return (self.sliding_window - 1, block_size)

    def describe(self) -> str:
        return f"swa{self.sliding_window} kv{self.num_kv_heads}x{self.head_dim} {self.dtype}"


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalSpec(AttentionSpec):
    """Chunked local attention (Llama 4 style): tokens attend within their chunk only."""

    kind: ClassVar[str] = CHUNKED_ATTENTION
    family: ClassVar[str] = "chunked_local"

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, attention_chunk_size=self.attention_chunk_size)

    def max_live_blocks(self, block_size: int, num_in_flight_tokens: int = 1) -> int:
        """An upper bound on live blocks: a chunk plus the step's tokens, unaligned."""
        span = self.attention_chunk_size + num_in_flight_tokens
        return -(-span // block_size) + 1

    def first_live_block(self, num_computed_tokens: int, block_size: int) -> int:
        # Tokens read only their own chunk: everything before its start is dead.
        chunk = self.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk // block_size

    def blocks_period(self, block_size: int) -> tuple[int, int] | None:
        return (0, math.lcm(self.attention_chunk_size, block_size))

    def describe(self) -> str:
        return f"chunk{self.attention_chunk_size} kv{self.num_kv_heads}x{self.head_dim}"


@dataclass(frozen=True, kw_only=True)
class MLASpec(LayerSpec):
    """Multi-head latent attention (DeepSeek): one latent "head" of rank + rope dims."""

    kind: ClassVar[str] = MLA
    family: ClassVar[str] = "mla"
    grows_with_tokens: ClassVar[bool] = True

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: DType = DType.BFLOAT16

    def __post_init__(self) -> None:
        require_positive(
            self, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim
        )

    def bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype.num_bytes

    def page_bytes(self, block_size: int, num_spec_tokens: int = 0) -> int:
        return block_size * self.bytes_per_token()

    def shard(self, tp: int) -> MLASpec:
        return self  # the latent is replicated on every rank

    def with_dtypes(
        self, kv: DType | None = None, conv: DType | None = None, ssm: DType | None = None
    ) -> MLASpec:
        return self if kv is None else dataclasses.replace(self, dtype=kv)

    def describe(self) -> str:
        return f"mla {self.kv_lora_rank}+{self.qk_rope_head_dim} {self.dtype}"

"""State specs: one page is one whole recurrent state; it never depends on the block size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from hybridkv.errors import SpecError
from hybridkv.spec.base import STATE, LayerSpec, divide_over_ranks, require_positive
from hybridkv.spec.dtypes import DType


@dataclass(frozen=True, kw_only=True)
class StateSpec(LayerSpec):
    """A fixed-size per-request state: conv rows plus a recurrent (ssm) tensor.

    Subclasses give `conv_channels`, `conv_width_base` (rows kept without drafts) and
    `ssm_shape`; whether drafts add conv rows is `keeps_spec_conv_rows`.
    """

    kind: ClassVar[str] = STATE
    grows_with_tokens: ClassVar[bool] = False
    keeps_spec_conv_rows: ClassVar[bool] = False
    fixed_ssm_dtype: ClassVar[DType | None] = None

    conv_dtype: DType = DType.BFLOAT16
    ssm_dtype: DType = DType.BFLOAT16

    # -- geometry, per rank
    def conv_channels(self) -> int:
        return 0

    def conv_width_base(self) -> int:
        return 0

    def ssm_shape(self) -> tuple[int, ...]:
        return ()

    def conv_shape(self, num_spec_tokens: int = 0) -> tuple[int, int]:
        """(channels, rows) of the conv state; zero-sized for families without conv."""
        if self.conv_channels() == 0:
            return (0, 0)
        extra = num_spec_tokens if self.keeps_spec_conv_rows else 0
        return (self.conv_channels(), self.conv_width_base() + extra)

    def effective_ssm_dtype(self) -> DType:
        return self.fixed_ssm_dtype or self.ssm_dtype

    def conv_bytes(self, num_spec_tokens: int = 0) -> int:
        channels, rows = self.conv_shape(num_spec_tokens)
        return channels * rows * self.conv_dtype.num_bytes

    def ssm_bytes(self) -> int:
        numel = 1
        for dim in self.ssm_shape():
            numel *= dim
        return numel * self.effective_ssm_dtype().num_bytes if self.ssm_shape() else 0

    def page_bytes(self, block_size: int = 0, num_spec_tokens: int = 0) -> int:
        """One whole state; ``block_size`` is accepted for uniformity and ignored."""
        return self.conv_bytes(num_spec_tokens) + self.ssm_bytes()

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
        """State blocks one request may hold during a step (``block_size`` = checkpoint
        interval B in ``align`` and ``all`` modes): the running state, one slot per kept
        draft (S, kept once taken: a later step with fewer drafts keeps them), one more
        while the running state is a cached checkpoint (``c`` on a boundary: the step
        must write elsewhere), and the checkpoints of boundaries strictly inside
        ``(c, c + n)``: align takes the last one only when that stays within ``2 + S``,
        all takes every one (transient: cached or freed when the step commits)::

            align, B 8, S 3: c 15 -> 4 (running + 3 drafts); c 16 -> 5 (the state
            after 16 tokens is cached, read only: the step writes a new block)
            all, B 8, S 0: c 16, n 20 -> 4 (cached running, write, checkpoints 24, 32)

        ``junction_tokens`` J (the ``junction`` rule's checkpoint of a request that started
        from a hit, 0: none) adds one transient block in the step with ``c < J < c + n``
        unless that position is checkpointed anyway: in ``all`` mode a boundary, in
        ``align`` mode the last boundary of a step that keeps it (no boundary read)::

            align, B 8, S 0: c 16 (a hit), n 20, J 24 -> 3 (cached running, write, J)

        Decode steps (n = 1) never cross one, so the planner's peak is unchanged.

        ``reads_checkpoint``: the step starts from a cached (read-only) state; None: at a
        boundary ``c > 0``. Under the ``turn_end`` rule a cached state may sit inside an
        interval too (a turn-end hit, a junction a chunk ended on): then say True.
        """
        base = 1 + num_spec_states
        if state_mode not in ("align", "all"):
            return base
        c, n = num_computed_tokens, num_new_tokens
        if reads_checkpoint is None:
            reads_checkpoint = c > 0 and c % block_size == 0
        boundary_read = 1 if reads_checkpoint else 0
        inside = max(0, (c + n - 1) // block_size - c // block_size)  # boundaries in (c, c+n)
        junction = 0
        if c < junction_tokens < c + n:
            on_boundary = junction_tokens % block_size == 0
            if state_mode == "all":
                junction = 0 if on_boundary else 1
            else:
                last = (c + n - 1) // block_size * block_size
                junction = 0 if not boundary_read and junction_tokens == last else 1
        if state_mode == "all":
            return base + boundary_read + inside + junction
        return base + (1 if boundary_read or inside else 0) + junction

    def blocks_period(self, block_size: int) -> tuple[int, int] | None:
        return (0, block_size)

    def with_dtypes(
        self, kv: DType | None = None, conv: DType | None = None, ssm: DType | None = None
    ) -> StateSpec:
        changes: dict[str, DType] = {}
        if conv is not None:
            changes["conv_dtype"] = conv
        if ssm is not None:
            changes["ssm_dtype"] = ssm
        return dataclasses.replace(self, **changes) if changes else self

    def describe(self) -> str:
        """Geometry and dtypes; the family is shown beside it as the group's kind."""
        channels, rows = self.conv_shape()
        conv = f"conv {channels}x{rows} {self.conv_dtype}, " if channels else ""
        ssm = "x".join(map(str, self.ssm_shape()))
        return f"{conv}ssm {ssm} {self.effective_ssm_dtype()}" if ssm else conv.rstrip(", ")


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec(StateSpec):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): conv over q,k,v + recurrent Hv x dv x dk."""

    family: ClassVar[str] = "gated_delta_net"
    keeps_spec_conv_rows: ClassVar[bool] = True

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require_positive(
            self,
            num_k_heads=self.num_k_heads,
            num_v_heads=self.num_v_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            conv_kernel=self.conv_kernel,
        )

    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def conv_width_base(self) -> int:
        return self.conv_kernel - 1

    def ssm_shape(self) -> tuple[int, ...]:
        return (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    def shard(self, tp: int) -> GatedDeltaNetSpec:
        return dataclasses.replace(
            self,
            num_k_heads=divide_over_ranks(self, "num_k_heads", self.num_k_heads, tp),
            num_v_heads=divide_over_ranks(self, "num_v_heads", self.num_v_heads, tp),
        )


@dataclass(frozen=True, kw_only=True)
class Mamba2Spec(StateSpec):
    """Mamba2 (Nemotron-H, Granite-4.0-H, Falcon-H1, Codestral Mamba)."""

    family: ClassVar[str] = "mamba2"
    keeps_spec_conv_rows: ClassVar[bool] = True

    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    intermediate_size: int | None = None  # None: num_heads * head_dim

    def __post_init__(self) -> None:
        require_positive(
            self,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            d_state=self.d_state,
            n_groups=self.n_groups,
            conv_kernel=self.conv_kernel,
        )

    @property
    def inner(self) -> int:
        return (
            self.num_heads * self.head_dim
            if self.intermediate_size is None
            else (self.intermediate_size)
        )

    def conv_channels(self) -> int:
        return self.inner + 2 * self.n_groups * self.d_state

    def conv_width_base(self) -> int:
        return self.conv_kernel - 1

    def ssm_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.d_state)

    def shard(self, tp: int) -> Mamba2Spec:
        # Groups fewer than ranks are replicated up to the TP size (vLLM does the same:
        # extra groups so every rank owns whole groups).
        if self.n_groups % tp == 0:
            groups = self.n_groups // tp
        elif tp % self.n_groups == 0:
            groups = 1
        else:
            raise SpecError(
                f"Mamba2 n_groups={self.n_groups} and tensor parallel size {tp} do not divide "
                "either way; use a TP size that divides n_groups or a multiple of it"
            )
        inner = (
            None
            if self.intermediate_size is None
            else divide_over_ranks(self, "intermediate_size", self.intermediate_size, tp)
        )
        return dataclasses.replace(
            self,
            num_heads=divide_over_ranks(self, "num_heads", self.num_heads, tp),
            n_groups=groups,
            intermediate_size=inner,
        )


@dataclass(frozen=True, kw_only=True)
class Mamba1Spec(StateSpec):
    """Mamba1 (Jamba): conv ``intermediate x (kernel - 1)``, ssm ``intermediate x d_state``."""

    family: ClassVar[str] = "mamba1"

    intermediate_size: int
    d_state: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require_positive(
            self,
            intermediate_size=self.intermediate_size,
            d_state=self.d_state,
            conv_kernel=self.conv_kernel,
        )

    def conv_channels(self) -> int:
        return self.intermediate_size

    def conv_width_base(self) -> int:
        return self.conv_kernel - 1

    def ssm_shape(self) -> tuple[int, ...]:
        return (self.intermediate_size, self.d_state)

    def shard(self, tp: int) -> Mamba1Spec:
        return dataclasses.replace(
            self,
            intermediate_size=divide_over_ranks(
                self, "intermediate_size", self.intermediate_size, tp
            ),
        )


@dataclass(frozen=True, kw_only=True)
class ShortConvSpec(StateSpec):
    """LFM2 short convolution: ``hidden x (L_cache - 1)`` conv rows, no recurrent matrix."""

    family: ClassVar[str] = "short_conv"

    hidden_size: int
    conv_l_cache: int

    def __post_init__(self) -> None:
        require_positive(self, hidden_size=self.hidden_size, conv_l_cache=self.conv_l_cache)

    def conv_channels(self) -> int:
        return self.hidden_size

    def conv_width_base(self) -> int:
        return self.conv_l_cache - 1

    def shard(self, tp: int) -> ShortConvSpec:
        return dataclasses.replace(
            self, hidden_size=divide_over_ranks(self, "hidden_size", self.hidden_size, tp)
        )


@dataclass(frozen=True, kw_only=True)
class KDASpec(StateSpec):
    """Kimi Delta Attention: short convs over q, k, v (3 x heads x dim), fp32 recurrent."""

    family: ClassVar[str] = "kda"
    fixed_ssm_dtype: ClassVar[DType | None] = DType.FLOAT32

    num_heads: int
    head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require_positive(
            self, num_heads=self.num_heads, head_dim=self.head_dim, conv_kernel=self.conv_kernel
        )

    def conv_channels(self) -> int:
        return 3 * self.num_heads * self.head_dim

    def conv_width_base(self) -> int:
        return self.conv_kernel - 1

    def ssm_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.head_dim)

    def shard(self, tp: int) -> KDASpec:
        return dataclasses.replace(
            self, num_heads=divide_over_ranks(self, "num_heads", self.num_heads, tp)
        )


@dataclass(frozen=True, kw_only=True)
class LightningSpec(StateSpec):
    """Lightning attention (MiniMax-Text-01): recurrent ``heads x d x d``, no conv."""

    family: ClassVar[str] = "lightning"

    num_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        require_positive(self, num_heads=self.num_heads, head_dim=self.head_dim)

    def ssm_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.head_dim)

    def shard(self, tp: int) -> LightningSpec:
        return dataclasses.replace(
            self, num_heads=divide_over_ranks(self, "num_heads", self.num_heads, tp)
        )


STATE_FAMILIES = ("gated_delta_net", "mamba2", "mamba1", "short_conv", "kda", "lightning")

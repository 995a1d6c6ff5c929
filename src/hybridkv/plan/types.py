"""The planner's inputs (`PlanOptions`) and output (`CachePlan`).

A `CachePlan` carries every number the runtime needs: which layers share a block table
(groups), how many tokens a block covers, which pool lends the blocks and how many pages
it has, where each layer's pages live in the pool's bytes, and what capacity follows.
The cache manager and the engine do no size arithmetic of their own.

Pool byte layout (one buffer per pool)::

    pool (num_pages pages, num_tensors tensor slots, page_bytes per page)
    +-- tensor 0: page 0 | page 1 | ... | page num_pages-1     <- layer a of every group
    +-- tensor 1: page 0 | page 1 | ...                          <- layer b of every group
    ...
    offset of (tensor t, page p) = (t * num_pages + p) * page_bytes

A block id ``p`` of group ``g`` names page ``p`` in each of the group's layers' tensors:
its *slab* is ``len(g.layers) * page_bytes``. Page 0 of every pool is the null block.

A ``slab``-packed pool (``num_tensors == 1``, ``page_bytes`` = the slab) instead lays a
block's layers side by side inside one slab, so groups may have different layer counts
and per-layer pages as long as their slabs are equal::

    slab p:  | layer a page | layer b page | layer c page |   (group of 3, pages S/3)
    slab p:  | layer x page ...  x6 ...                  |   (group of 6, pages S/6)
    offset of (layer i, block p) = p * slab + i * group's padded page
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridkv.errors import PlanError
from hybridkv.ids import cdiv
from hybridkv.plan.peak import peak_blocks
from hybridkv.spec.dtypes import DType
from hybridkv.spec.layers import (
    STATE,
    ChunkedLocalSpec,
    LayerSpec,
    SlidingWindowSpec,
    StateSpec,
)

LAYOUTS = ("auto", "shared", "split", "vllm")
SPEC_METHODS = ("draft", "eagle", "mtp", "ngram", "suffix")
STATE_MODES = ("align", "all", "none")  # see `hybridkv.cache.managers.state`
PACKINGS = ("any", "tensor")  # "tensor": no slab-packed pools (engines with one page per tensor)
DEFAULT_BLOCK_ALIGN_TOKENS = 16  # GPU attention kernels (FlashAttention, FlashInfer)
# K, draft tokens per step, for every command and API (plan, simulate, trace-gen, generate,
# serve, demo, `LLM`): no proposer gains from more, and each draft token widens every
# request's state rows and lookahead blocks, so a larger K only shrinks capacity.
MAX_SPEC_TOKENS = 256


def check_num_spec_tokens(k: object, what: str = "num_spec_tokens") -> int:
    """``k`` when it is an integer from 0 to `MAX_SPEC_TOKENS`, else `PlanError` naming
    ``what`` (the flag or argument the caller reads K from)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPEC_TOKENS:
        raise PlanError(
            f"{what}={k!r}: K must be an integer from 0 to {MAX_SPEC_TOKENS} (draft tokens "
            "per step; 4 to 16 is typical)"
        )
    return k


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything the planner needs besides the model specs. Defaults follow vLLM's."""

    spec_method: str | None = None
    num_spec_tokens: int = 0
    kv_dtype: DType | None = None  # None: the model's dtype
    conv_dtype: DType | None = None
    ssm_dtype: DType | None = None
    tp: int = 1
    max_model_len: int | None = None  # None: the main model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_caching: bool = True
    state_mode: str | None = None  # align | all | none; None: "align" with caching, else none
    memory_bytes: int = 64 << 30
    block_size: int | None = None  # user-chosen attention block size (tokens)
    layout: str = "auto"
    target_len: int | None = None  # None: max_model_len
    typical_len: int | None = None  # None: min(8192, max_model_len)
    max_block_size: int | None = None  # cap on attention blocks (prefix-hit granularity)
    # Attention block sizes are multiples of this (the attention kernel's block unit:
    # 16 for GPU kernels, 32 for vLLM's CPU attention backend).
    block_align_tokens: int = DEFAULT_BLOCK_ALIGN_TOKENS
    packing: str = "any"  # see PACKINGS
    # Models ("main" / "draft") whose layers of one kind must share one block table:
    # vLLM's draft proposer reads every draft layer through one KV-cache group
    # (`validate_same_kv_cache_group`, vllm/v1/spec_decode/llm_base_proposer.py, 0.33).
    one_group_models: tuple[str, ...] = ()

    @property
    def resolved_state_mode(self) -> str:
        if self.state_mode is not None:
            return self.state_mode
        return "align" if self.prefix_caching else "none"

    @property
    def num_spec_states(self) -> int:
        """S: draft positions whose state must be kept (0 without speculative decoding)."""
        return self.num_spec_tokens if self.spec_method else 0


@dataclass(frozen=True, kw_only=True)
class LayerRef:
    """A layer named by model ("main" / "draft") and index in that model's spec."""

    model: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.model}.{self.index}"


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Layers sharing one block table per request.

    ``block_size`` is tokens per block (for a state group: the checkpoint interval in
    ``align`` mode). ``page_bytes`` is one layer's raw page, ``padded_page_bytes`` the
    page it occupies in its pool.
    """

    group_id: int
    model: str
    spec: LayerSpec
    layers: tuple[LayerRef, ...]
    block_size: int
    page_bytes: int
    padded_page_bytes: int
    pool_id: int
    num_spec_states: int = 0
    state_mode: str = "none"

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def state_family(self) -> str | None:
        return self.spec.family if isinstance(self.spec, StateSpec) else None

    @property
    def waste_bytes_per_block(self) -> int:
        return (self.padded_page_bytes - self.page_bytes) * len(self.layers)

    @property
    def is_state(self) -> bool:
        """True for recurrent-state groups (slots per request, no per-token pages)."""
        return self.kind == STATE

    def blocks_at(
        self,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead: int,
        junction_tokens: int = 0,
        reads_checkpoint: bool | None = None,
    ) -> int:
        """Blocks one request holds here during a step (`LayerSpec.blocks_needed`;
        ``junction_tokens``, ``reads_checkpoint``: state groups, see `StateSpec`)."""
        return self.spec.blocks_needed(
            block_size=self.block_size,
            num_computed_tokens=num_computed_tokens,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead,
            num_spec_states=self.num_spec_states,
            state_mode=self.state_mode,
            junction_tokens=junction_tokens,
            reads_checkpoint=reads_checkpoint,
        )

    def blocks_period(self) -> tuple[int, int] | None:
        return self.spec.blocks_period(self.block_size)

    @property
    def peak_key(self) -> tuple[Any, ...]:
        """What `blocks_at` depends on: equal keys count equal blocks at every step."""
        return (self.spec, self.block_size, self.num_spec_states, self.state_mode)

    def blocks_bound(self, num_tokens: int, num_new_tokens: int, num_lookahead: int) -> int:
        if self.is_state:  # the largest value: right after a checkpoint boundary
            return self.blocks_at(self.block_size, num_new_tokens, num_lookahead)
        blocks = cdiv(num_tokens + num_lookahead, self.block_size)
        if isinstance(self.spec, SlidingWindowSpec | ChunkedLocalSpec):
            live = self.spec.max_live_blocks(self.block_size, num_new_tokens + num_lookahead)
            blocks = min(blocks, live)
        return blocks

    def blocks_needed(
        self, num_tokens: int, num_lookahead_tokens: int = 0, num_new_tokens: int = 1
    ) -> int:
        """Peak blocks one request holds in this group while it steps to ``num_tokens``
        tokens, ``num_new_tokens`` at a time with ``num_lookahead_tokens`` drafts
        (`hybridkv.plan.peak`): the one formula behind capacity, admission and the
        capacity report. For a set of groups sharing a pool use `plan.peak.peak_blocks`
        (groups peak at different steps).

        Example: full attention, block 16, 40 tokens + 3 drafts -> cdiv(43, 16) = 3;
        sliding W 1024, block 16, 1 token + 3 drafts, long context -> cdiv(1026, 16) + 1 = 66.
        """
        return peak_blocks([self], num_tokens, num_new_tokens, num_lookahead_tokens)

    # Older name, kept for callers outside the package.
    blocks_for = blocks_needed

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "kind": self.kind,
            "state_family": self.state_family,
            "model": self.model,
            "layers": [ref.name for ref in self.layers],
            "num_layers": len(self.layers),
            "spec": self.spec.describe(),
            "block_size": self.block_size,
            "page_bytes": self.page_bytes,
            "padded_page_bytes": self.padded_page_bytes,
            "pool": self.pool_id,
        }


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """A region cut into ``num_pages`` pages per tensor slot; page 0 is the null block."""

    pool_id: int
    page_bytes: int
    num_pages: int
    num_tensors: int
    group_ids: tuple[int, ...]
    packing: str = "tensor"  # "tensor": a tensor slot per layer; "slab": layers side by side

    @property
    def num_usable_blocks(self) -> int:
        return self.num_pages - 1

    @property
    def slab_bytes(self) -> int:
        return self.page_bytes * self.num_tensors

    @property
    def total_bytes(self) -> int:
        return self.slab_bytes * self.num_pages

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool_id": self.pool_id,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "num_tensors": self.num_tensors,
            "total_bytes": self.total_bytes,
            "groups": list(self.group_ids),
            "packing": self.packing,
        }


@dataclass(frozen=True, kw_only=True)
class TensorPlacement:
    """Where one layer's pages live: ``offset_bytes + page * page_stride_bytes``."""

    layer: LayerRef
    group_id: int
    pool_id: int
    tensor_index: int
    offset_bytes: int
    page_stride_bytes: int
    used_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer.name,
            "group": self.group_id,
            "pool": self.pool_id,
            "tensor_index": self.tensor_index,
            "offset_bytes": self.offset_bytes,
            "page_stride_bytes": self.page_stride_bytes,
            "used_bytes": self.used_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class Capacity:
    max_model_len: int
    target_len: int
    typical_len: int
    blocks_per_request_at_target: dict[int, int]  # group id -> blocks
    max_concurrency: int  # whole requests at target_len
    max_concurrency_float: float
    concurrency_at_typical: int
    # Context tokens (summed over requests) each token-indexed group can hold while its
    # pool also holds what the other groups need for the same requests: state and
    # window groups their peak for max(max_concurrency, 1) requests at target_len,
    # full-attention groups the same tokens. Not the pool's blocks times the block size
    # (that would count the whole pool once per group). See `capacity._tokens_per_group`.
    tokens_per_group: dict[int, int]
    state_slots: int  # requests whose state fits (sum over state groups: the minimum)
    max_num_seqs: int
    max_num_seqs_that_fit: int

    @property
    def max_num_seqs_fits(self) -> bool:
        return self.max_num_seqs <= self.max_num_seqs_that_fit

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "target_len": self.target_len,
            "typical_len": self.typical_len,
            "max_concurrency": self.max_concurrency,
            "max_concurrency_float": round(self.max_concurrency_float, 3),
            "concurrency_at_typical_len": self.concurrency_at_typical,
            "blocks_per_request_at_target": {
                str(k): v for k, v in self.blocks_per_request_at_target.items()
            },
            "tokens_per_group": {str(k): v for k, v in self.tokens_per_group.items()},
            "state_slots": self.state_slots,
            "max_num_seqs": self.max_num_seqs,
            "max_num_seqs_that_fit": self.max_num_seqs_that_fit,
            "max_num_seqs_fits": self.max_num_seqs_fits,
        }


@dataclass(frozen=True, kw_only=True)
class CachePlan:
    """One memory plan: groups, pools, placement, capacity, waste, warnings."""

    layout: str
    main_model: str
    draft_model: str | None
    options: PlanOptions
    groups: tuple[GroupPlan, ...]
    pools: tuple[PoolPlan, ...]
    tensors: tuple[TensorPlacement, ...]
    capacity: Capacity
    memory_bytes: int
    used_bytes: int
    waste_bytes: int
    hit_granularity_tokens: int
    warnings: tuple[str, ...] = ()
    reason: str = ""
    alternatives: tuple[CachePlan, ...] = field(default=(), compare=False)

    @property
    def waste_fraction(self) -> float:
        return self.waste_bytes / self.memory_bytes if self.memory_bytes else 0.0

    def check_invariants(self) -> None:
        """Raise `InvariantError` if the plan contradicts itself (see `plan.checks`)."""
        from hybridkv.plan.checks import check_plan_invariants

        check_plan_invariants(self)

    def group(self, group_id: int) -> GroupPlan:
        return self.groups[group_id]

    def pool(self, pool_id: int) -> PoolPlan:
        return self.pools[pool_id]

    def summary(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "max_concurrency": self.capacity.max_concurrency,
            "max_concurrency_float": round(self.capacity.max_concurrency_float, 3),
            "concurrency_at_typical_len": self.capacity.concurrency_at_typical,
            "waste_bytes": self.waste_bytes,
            "waste_fraction": round(self.waste_fraction, 6),
            "attention_block_sizes": sorted(
                {g.block_size for g in self.groups if g.kind != "state"}
            ),
            "hit_granularity_tokens": self.hit_granularity_tokens,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "reason": self.reason,
            "main_model": self.main_model,
            "draft_model": self.draft_model,
            "groups": [g.to_dict() for g in self.groups],
            "pools": [p.to_dict() for p in self.pools],
            "tensors": [t.to_dict() for t in self.tensors],
            "memory_bytes": self.memory_bytes,
            "used_bytes": self.used_bytes,
            "waste_bytes": self.waste_bytes,
            "waste_fraction": round(self.waste_fraction, 6),
            "hit_granularity_tokens": self.hit_granularity_tokens,
            "capacity": self.capacity.to_dict(),
            "alternatives": [alt.summary() for alt in self.alternatives],
            "warnings": list(self.warnings),
        }

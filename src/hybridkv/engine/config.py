"""`EngineConfig`: everything an `LLM` is built with besides its checkpoint, in one
frozen record::

    LLM(folder, config=EngineConfig(
        dtype="bfloat16",
        memory_bytes=256 << 20,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
    ))

The scheduling limits are the one `hybridkv.sched.SchedulerConfig` the simulator and
the server run with too (``llm.scheduler.config`` is the config a running engine
uses). The engine fills in what it derives itself: ``max_model_len`` when the
scheduler's is None (the checkpoint's positions, at most 4096), ``max_spec_tokens``
from the speculative method and K, ``chunk_align_tokens`` from the plan; those two must
stay at their defaults here.

Keywords describe the same record: ``LLM(folder, dtype=..., max_num_seqs=...)`` builds its
config with `EngineConfig.from_keywords` (scheduling keywords into its `SchedulerConfig`,
planner options such as ``state_mode`` into ``plan_options``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from hybridkv.cache.free_queue import DEFAULT_EVICTION_POLICY
from hybridkv.engine.speculative.proposers import Proposer
from hybridkv.errors import EngineError
from hybridkv.plan.types import PlanOptions
from hybridkv.sched import SchedulerConfig

if TYPE_CHECKING:
    from typing_extensions import Unpack

DEFAULT_MEMORY_BYTES = 64 << 20  # tiny CPU models: plenty, and allocated eagerly
# The engine's own scheduling defaults: a CPU reference engine runs few, short steps.
ENGINE_SCHEDULER_DEFAULTS = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)

# Keywords of `from_keywords` that go into the `SchedulerConfig`.
SCHEDULER_KEYWORDS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "chunk_size",
    "max_model_len",
    "cache_aware",
)
# `PlanOptions` fields the engine sets from its own config (or from the checkpoint).
ENGINE_PLAN_FIELDS = frozenset(
    {
        "kv_dtype",
        "conv_dtype",
        "ssm_dtype",
        "memory_bytes",
        "block_size",
        "layout",
        "prefix_caching",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "spec_method",
        "num_spec_tokens",
    }
)
# Planner options a caller may still pass (``plan_options`` / keywords), e.g. ``state_mode``.
PLAN_KEYWORDS = frozenset(f.name for f in dataclasses.fields(PlanOptions)) - ENGINE_PLAN_FIELDS


class EngineKeywords(TypedDict, total=False):
    """`LLM`'s keyword arguments: `EngineConfig`'s fields, the scheduling limits of its
    `SchedulerConfig`, and the planner options of ``plan_options``."""

    dtype: str
    kv_dtype: str | None
    device: str | torch.device
    memory_bytes: int
    block_size: int | None
    layout: str
    prefix_caching: bool
    eviction_policy: str
    checkpoint_rules: Sequence[str] | None
    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_size: int | None
    max_model_len: int | None
    cache_aware: bool
    draft: str | Path | None
    spec_method: str | None
    num_spec_tokens: int
    proposer: Proposer | None
    spec_topk: int
    spec_tree: Sequence[Sequence[int]] | None
    torch_compile: bool
    keep_freed_pages: bool
    # planner options (`PlanOptions`), passed through
    tp: int
    state_mode: str | None
    target_len: int | None
    typical_len: int | None
    max_block_size: int | None
    block_align_tokens: int
    packing: str
    one_group_models: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an `LLM` runs its checkpoint (module doc).

    Numbers: ``dtype`` of weights, activations and cache (``float32``, ``bfloat16``,
    ``float16``); ``kv_dtype`` of the KV pages (None: ``dtype``; ``fp8_e4m3`` /
    ``fp8_e5m2``: fp8 pages). ``device``: ``cpu``, ``cuda``, ``cuda:N``.

    The cache plan: ``memory_bytes`` for the cache, ``block_size`` (None: the planner's
    choice), ``layout`` (``auto`` or a planner layout), ``prefix_caching``,
    ``eviction_policy`` and ``checkpoint_rules`` of the `CacheManager`, and
    ``plan_options``: further `PlanOptions` fields (``state_mode``, ``tp``...).

    Scheduling: ``scheduler``, the `SchedulerConfig` (module doc).

    Speculative decoding: ``draft`` folder (a draft model or an EAGLE / MTP head),
    ``spec_method`` (``draft``, ``eagle``, ``mtp``, ``ngram``, ``suffix``),
    ``num_spec_tokens`` K, ``proposer`` (a custom `Proposer`), and with a head a token
    tree: ``spec_topk`` k or ``spec_tree`` (paths of child ranks).

    Process-wide switches: ``torch_compile`` (compiled bf16 / fp16 paths on the CPU),
    ``keep_freed_pages`` (glibc keeps freed memory for reuse; CPU only).
    """

    dtype: str = "float32"
    kv_dtype: str | None = None
    device: str | torch.device = "cpu"
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    block_size: int | None = None
    layout: str = "auto"
    prefix_caching: bool = True
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    checkpoint_rules: tuple[str, ...] | None = None
    plan_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    scheduler: SchedulerConfig = ENGINE_SCHEDULER_DEFAULTS
    draft: str | Path | None = None
    spec_method: str | None = None
    num_spec_tokens: int = 0
    proposer: Proposer | None = None
    spec_topk: int = 1
    spec_tree: tuple[tuple[int, ...], ...] | None = None
    torch_compile: bool = False
    keep_freed_pages: bool = True

    def __post_init__(self) -> None:
        # Sequences become tuples and the options a read-only copy, so that a config
        # cannot change after it was checked (or under an `LLM` built from it).
        if self.checkpoint_rules is not None:
            object.__setattr__(self, "checkpoint_rules", tuple(self.checkpoint_rules))
        if self.spec_tree is not None:
            tree = tuple(tuple(int(i) for i in path) for path in self.spec_tree)
            object.__setattr__(self, "spec_tree", tree)
        object.__setattr__(self, "plan_options", MappingProxyType(dict(self.plan_options)))
        unknown = sorted(set(self.plan_options) - PLAN_KEYWORDS)
        if unknown:
            owned = [k for k in unknown if k in ENGINE_PLAN_FIELDS]
            raise EngineError(
                f"plan_options {unknown}: "
                + (
                    f"{owned} are set by the engine (use the EngineConfig / SchedulerConfig "
                    "fields of the same meaning); "
                    if owned
                    else ""
                )
                + f"the planner options an engine passes through are {sorted(PLAN_KEYWORDS)}"
            )
        derived = {
            "max_spec_tokens": (self.scheduler.max_spec_tokens, None),
            "chunk_align_tokens": (self.scheduler.chunk_align_tokens, 0),
        }
        for name, (value, default) in derived.items():
            if value != default:
                raise EngineError(
                    f"scheduler.{name}={value}: the engine derives it (from num_spec_tokens "
                    f"and the plan); leave it at {default}"
                )

    @classmethod
    def from_keywords(cls, **keywords: Unpack[EngineKeywords]) -> EngineConfig:
        """The config `LLM`'s keywords describe (defaults for the ones not given)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"scheduler", "plan_options"}
        sched: dict[str, Any] = {}
        plan: dict[str, Any] = {}
        fields: dict[str, Any] = {}
        for name, value in keywords.items():
            if name in SCHEDULER_KEYWORDS:
                sched[name] = value
            elif name in own:
                fields[name] = value
            elif name in PLAN_KEYWORDS:
                plan[name] = value
            else:
                raise EngineError(
                    f"LLM got an unknown keyword {name!r}; it takes EngineConfig's fields, "
                    f"{', '.join(SCHEDULER_KEYWORDS)} and the planner options "
                    f"{', '.join(sorted(PLAN_KEYWORDS))}"
                )
        scheduler = dataclasses.replace(ENGINE_SCHEDULER_DEFAULTS, **sched)
        return cls(scheduler=scheduler, plan_options=plan, **fields)

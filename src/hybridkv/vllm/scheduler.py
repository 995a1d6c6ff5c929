"""`Scheduler`: vLLM's own scheduler, with hybridkv's `CacheManager` as its KV-cache
manager. ``vllm serve MODEL --scheduler-cls hybridkv.vllm.Scheduler``.

Why this seat: ``--scheduler-cls`` is the one place vLLM lets a user replace what owns
the KV-cache manager, and subclassing its scheduler keeps every scheduling decision
(budgets, chunked prefill, preemption order, spec-decode bookkeeping, outputs) vLLM's
own; only the manager behind it changes (`hybridkv.vllm.kv_manager`). Three methods
change: ``schedule`` commits the steps whose output arrived (with async scheduling:
whose tokens are known), ``update_from_output``
marks the step as run, and the align-mode chunk split ends prefill chunks where
hybridkv checkpoints (vLLM's workers write a state only where a step ends).

Speculative decoding with drafters that keep no KV (n-gram, suffix, ``custom_class``),
with a separate draft model and with MTP heads runs on hybridkv's manager, state layers
included: their rows carry the worker's draft columns
(`hybridkv.cache.managers.state_columns`); a draft model's layers are attention groups of
their own; an MTP layer sits in the main model's attention group, whose KV at position p
then depends on token p + 1, so that group's blocks are keyed one token ahead (a block is
hit only where the token after it matches too, where vLLM 0.32 drops the last matched
block of every hit instead). vLLM's lookahead (K slots for the drafter's KV) is reserved
in every attention group and in no state group. Left to vLLM's own KV-cache manager, with
one warning naming the reason: KV connectors (P/D disaggregation, offloading), pipeline
parallelism, decode context parallelism, EAGLE heads and multi-module MTP (not run on a
hybrid here; multi-module MTP keys K tokens ahead), and layer kinds without a hybridkv
manager (cross-attention...).

Async scheduling (``scheduler_config.async_scheduling``, vLLM 0.33's default on GPUs)
stays on: vLLM builds the ``--scheduler-cls`` class whatever the setting
(``SchedulerConfig.get_scheduler_cls``, vllm/config/scheduler.py 0.33:231-256), so this
class picks vLLM's ``AsyncScheduler`` behaviour itself at construction (`__new__`: the
subclass `AsyncScheduler` below, same flag). The manager then commits each step one
schedule late, once the token the step before sampled is known (`hybridkv.vllm.
steps`); with speculative decoding a step scheduled before the previous one's accepted
count is known holds every block it may need on top of it. vLLM-CPU turns async
scheduling off on every setup (vllm/platforms/cpu.py 0.32:331, 0.33:348).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from hybridkv.vllm.events import vllm_event_log
from hybridkv.vllm.kv_manager import VllmKVCacheManager
from hybridkv.vllm.kv_plan import UnsupportedVllmSetup, vllm_groups
from hybridkv.vllm.rows import split_prefill_chunk

logger = logging.getLogger("vllm.hybridkv")
# speculative methods whose drafter keeps no KV cache: only the main model's groups
# (draft columns in state groups) change
DRAFTERS_WITHOUT_KV = ("ngram", "ngram_gpu", "suffix", "custom_class")
# a separate draft model: its layers form attention groups of their own, keyed like the
# main model's (its KV at p depends on tokens <= p); every allocation carries vLLM's
# lookahead (K) for them, which hybridkv reserves in every attention group
DRAFTERS_WITH_KV = ("draft_model",)
# MTP heads (vLLM normalises qwen3_next_mtp, qwen3_5_mtp... to "mtp"): the head's layer
# joins the main attention group, keyed one token ahead; one module only
DRAFT_HEADS = ("mtp",)
MANAGED_DRAFTERS = DRAFTERS_WITHOUT_KV + DRAFTERS_WITH_KV + DRAFT_HEADS


def _prefix_cache_stats_cls() -> Any:
    try:
        from vllm.v1.metrics.stats import PrefixCacheStats
    except ImportError:  # pragma: no cover - both supported versions have it
        return None
    return PrefixCacheStats


class Scheduler(VllmScheduler):
    """vLLM's scheduler over hybridkv's cache manager (see the module docstring)."""

    hybridkv_active = False  # until __init__ takes the KV cache (vLLM's tests skip __init__)

    def __new__(cls, *args: Any, **kwargs: Any) -> Scheduler:
        # vLLM builds the class named by --scheduler-cls whether or not async scheduling
        # is on; its engine core then runs a batch queue of 2, which only vLLM's
        # AsyncScheduler bookkeeping (output placeholders) follows
        config = kwargs.get("vllm_config", args[0] if args else None)
        sched = getattr(config, "scheduler_config", None)
        target = cls
        if cls is Scheduler and getattr(sched, "async_scheduling", False):
            target = AsyncScheduler
        return object.__new__(target)

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.hybridkv_active = False
        try:
            _check_supported(self, vllm_config)
            spec = vllm_config.speculative_config
            head = spec is not None and getattr(spec, "method", None) in DRAFT_HEADS
            groups = vllm_groups(kv_cache_config, draft_head=head)
            _check_draft_columns(groups, self.num_spec_tokens, self.cache_config)
        except UnsupportedVllmSetup as err:
            # as the plugin does with plans: what hybridkv cannot translate stays vLLM's
            logger.warning("hybridkv: %s; vLLM's own KV-cache manager stays", err)
            return
        self.hybridkv_active = True
        # the form built decides (`__new__` from the config; vLLM's tests name it)
        async_steps = isinstance(self, VllmAsyncScheduler)
        state_mode = getattr(self.cache_config, "mamba_cache_mode", "none") or "none"
        caching = bool(self.cache_config.enable_prefix_caching)
        self.kv_cache_manager = VllmKVCacheManager(  # type: ignore[assignment]
            groups,
            num_blocks=kv_cache_config.num_blocks,
            enable_caching=caching,
            state_mode=state_mode if caching else "none",
            num_spec_tokens=self.num_spec_tokens,
            blocks_cls=KVCacheBlocks,
            copy_cls=KVCacheBlockCopy,
            stats_cls=_prefix_cache_stats_cls(),
            log_stats=self.log_stats,
            group_specs=[g.kv_cache_spec for g in kv_cache_config.kv_cache_groups],
            events=vllm_event_log(self, kv_cache_config, groups),
            num_lookahead_tokens=self.num_lookahead_tokens,
            async_steps=async_steps,
        )
        # vLLM's own Mamba split rules read its manager; hybridkv's split replaces them
        self.mamba_partial_cache_hit = False
        self.mamba_shared_prefix_checkpoint = False
        self.mamba_has_prefill_checkpoint_blocks = False
        self.state_block_size = min((g.block_size for g in groups if g.kind == "state"), default=0)
        logger.info(
            "hybridkv: vLLM's scheduler runs on hybridkv's cache manager (%d groups: %s; "
            "%d blocks; prefix caching %s, state mode %s; async scheduling %s)",
            len(groups),
            ", ".join(f"{g.kind}/{g.block_size}" for g in groups),
            kv_cache_config.num_blocks,
            "on" if caching else "off",
            state_mode if caching else "none",
            "on" if async_steps else "off",
        )

    # ------------------------------------------------------------------ the seams
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if not self.hybridkv_active:
            return super().schedule(*args, **kwargs)
        manager = self.kv_cache_manager
        manager.settle(self.requests)  # type: ignore[attr-defined]
        output = super().schedule(*args, **kwargs)
        manager.schedule_done()  # type: ignore[attr-defined]
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not self.hybridkv_active:
            return super().update_from_output(scheduler_output, model_runner_output)
        manager = self.kv_cache_manager
        manager.mark_executed()  # type: ignore[attr-defined]
        # what the worker sampled, before vLLM drops the tokens past a stop
        sampled = model_runner_output.sampled_token_ids
        manager.outputs_arriving(  # type: ignore[attr-defined]
            model_runner_output.req_id_to_index, () if sampled is None else sampled
        )
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        # steps scheduled ahead of this output start where its accepted drafts end
        manager.outputs_processed(  # type: ignore[attr-defined]
            self.requests, scheduler_output.num_scheduled_tokens
        )
        return outputs

    def _mamba_block_aligned_split(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """End a prefill chunk on the last state boundary strictly inside it, so the
        state there is written (at the chunk's end) and checkpointed."""
        if not self.hybridkv_active:
            return super()._mamba_block_aligned_split(  # type: ignore[no-any-return]
                request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
            )
        start = request.num_computed_tokens + num_new_local_computed_tokens
        start += num_external_computed_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        junction = self.kv_cache_manager.junction_point(request)  # type: ignore[attr-defined]
        return split_prefill_chunk(
            start, num_new_tokens, prefill_end, self.state_block_size, junction
        )

    def _free_cow_retained_blocks(self, blocks: Any, fence_seq: int) -> None:
        """hybridkv pins a copy's source until the step commits: nothing is retained."""
        if not self.hybridkv_active:
            super()._free_cow_retained_blocks(blocks, fence_seq)

    def _request_remaining_blocks(self, request: Any) -> int:
        """Only read for connector loads, which hybridkv's scheduler leaves to vLLM."""
        if not self.hybridkv_active:
            return super()._request_remaining_blocks(request)  # type: ignore[no-any-return]
        return 0

    def check_invariants(self) -> None:
        if self.hybridkv_active:
            self.kv_cache_manager.check_invariants()  # type: ignore[attr-defined]


class AsyncScheduler(Scheduler, VllmAsyncScheduler):
    """`Scheduler` with vLLM's async-scheduling bookkeeping (output placeholders, one
    step in flight); `Scheduler` builds this when ``async_scheduling`` is on."""


def _check_supported(scheduler: Any, vllm_config: Any) -> None:
    reasons = []
    if getattr(scheduler, "connector", None) is not None:
        reasons.append("a KV connector (kv_transfer_config) is configured")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        reasons.append(
            f"pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size}"
        )
    if getattr(scheduler, "dcp_world_size", 1) > 1:
        reasons.append(f"decode context parallelism ({scheduler.dcp_world_size})")
    if getattr(getattr(vllm_config, "aux_output_config", None), "enabled", False):
        reasons.append(
            "auxiliary outputs (enable_return_routed_experts: vLLM's aux-output connector "
            "holds vLLM's own block pool)"
        )
    spec = vllm_config.speculative_config
    if spec is not None:
        method = getattr(spec, "method", None)
        if method not in MANAGED_DRAFTERS:
            reasons.append(
                f"speculative method {method!r} (its drafter's KV groups are not translated "
                f"yet; {', '.join(MANAGED_DRAFTERS)} are)"
            )
        ahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1) or 0)
        if method in DRAFT_HEADS and ahead > 1:
            reasons.append(
                f"multi-module MTP (its drafter reads {ahead} tokens ahead; hybridkv keys "
                "one token ahead)"
            )
        mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none") or "none"
        if _has_state(scheduler) and mode not in ("align", "none"):
            reasons.append(f"speculative decoding with mamba_cache_mode={mode!r}")
    if reasons:
        raise UnsupportedVllmSetup(
            "hybridkv.vllm.Scheduler does not translate this engine's KV cache: "
            + "; ".join(reasons)
        )


def _check_draft_columns(groups: list[Any], num_spec_tokens: int, cache_config: Any) -> None:
    """Drafts on state layers in align mode: one step's drafts may cross at most one
    state boundary (vLLM's post-copy checkpoints only the last one it reaches)."""
    if not num_spec_tokens or not cache_config.enable_prefix_caching:
        return
    for g in groups:
        if g.kind == "state" and num_spec_tokens >= g.block_size:
            raise UnsupportedVllmSetup(
                f"{num_spec_tokens} speculative tokens with state group {g.group_id}'s "
                f"{g.block_size}-token blocks: a step's drafts could cross two checkpoint "
                "boundaries; use fewer speculative tokens"
            )


def _has_state(scheduler: Any) -> bool:
    return bool(getattr(scheduler, "has_mamba_layers", False))

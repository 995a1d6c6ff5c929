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

import dataclasses
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

from hybridkv.errors import HybridKVError, PlanError
from hybridkv.plan import CachePlan, PlanOptions, plan
from hybridkv.plan.types import DEFAULT_BLOCK_ALIGN_TOKENS
from hybridkv.vllm.backend_facts import backend_align_tokens, dtype_name
from hybridkv.vllm.planning import SPEC_METHODS, _dtype

logger = logging.getLogger("vllm.hybridkv")
BUILDER_QUALNAME = "hybridkv.vllm.builder.HybridKVConfigBuilder"
# vLLM sizes the pool after grouping; plans are compared on a nominal budget big enough
# for a few long requests of a large model, and capacity is reported per GiB.
PLAN_KV_BYTES = 64 << 30
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
# A separate draft model is mapped here (the grouping sees its layers); the block-size
# hook's table leaves it out.
BUILDER_SPEC_METHODS = {**SPEC_METHODS, "draft_model": "draft"}


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


def _layer_key(name: str, spec: KVCacheSpec) -> tuple[str, int]:
    """vLLM's layer name -> hybridkv's (model, layer index)."""
    found = _LAYER_INDEX.search(name)
    if found is None:
        raise PlanError(f"vLLM layer {name!r} names no layer index; hybridkv cannot map it")
    return ("draft" if spec.is_draft else "main", int(found.group(1)))


def kernel_align_tokens(vllm_config: Any) -> int:
    """The attention kernels' block unit (lcm over this process's attention layers);
    block-outer pages are never split into kernel blocks, so hybridkv's blocks must be
    multiples of it. Without layers here (no model built in this process): 16, the
    unit of vLLM's CUDA kernels (FlashAttention, FlashInfer: ``MultipleOf(16)``)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
    backends = {layer.get_attn_backend() for layer in layers.values()}
    units = [backend_align_tokens(b) for b in backends if not b.is_ssm()]
    return math.lcm(*units) if units else DEFAULT_BLOCK_ALIGN_TOKENS


def has_state_layers(specs: dict[str, KVCacheSpec]) -> bool:
    """Where vLLM pads pages (state layers beside attention), hybridkv plans; a model
    without state layers keeps vLLM's grouping and layout untouched, silently."""
    return any(isinstance(spec, MambaSpec) for spec in specs.values())


def _check_supported(vllm_config: Any, specs: dict[str, KVCacheSpec], layout: Any) -> None:
    if not layout.is_block_outermost:
        raise PlanError(
            f"KV cache layout {layout.name} is layer-outer: vLLM needs one page size for "
            "every layer there, so hybridkv's packed groups cannot be expressed; set "
            "VLLM_KV_CACHE_LAYOUT=BLNHC (block-outermost) where the backends support it"
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise PlanError("the hybrid KV cache manager is disabled (one group only)")
    if vllm_config.attention_config.hisparse_config is not None:
        raise PlanError("HiSparse owns its own grouping")
    if vllm_config.model_config.supports_kv_cache_grouping:
        raise PlanError("the model declares its own KV-cache grouping")
    others = sorted(
        {type(s).__name__ for s in specs.values() if type(s) not in (FullAttentionSpec, MambaSpec)}
    )
    if others:
        raise PlanError(f"spec types {others} are not mapped to hybridkv's layer specs")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        raise PlanError("decode context parallelism shards attention pages; not mapped")
    for name, spec in specs.items():
        if isinstance(spec, FullAttentionSpec) and (
            spec.sliding_window or spec.attention_chunk_size
        ):
            raise PlanError(f"layer {name}: windowed attention is not mapped")


def _options(vllm_config: Any, specs: dict[str, KVCacheSpec], align: int) -> PlanOptions:
    """hybridkv's options from the facts vLLM's specs and config carry."""
    cache = vllm_config.cache_config
    spec_config = vllm_config.speculative_config
    vllm_method = getattr(spec_config, "method", None) if spec_config else None
    method = BUILDER_SPEC_METHODS.get(vllm_method) if vllm_method else None
    if vllm_method and method is None:
        raise PlanError(f"speculative method {vllm_method!r} is not mapped to hybridkv's")
    attention = [s for s in specs.values() if isinstance(s, FullAttentionSpec)]
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    # fp8 pages are stored as uint8 in the spec; the cache dtype names the format
    kv_dtypes = {
        dtype_name(s.dtype if cache.cache_dtype == "auto" else cache.cache_dtype) for s in attention
    }
    if len(kv_dtypes) > 1:
        raise PlanError(f"attention layers use several KV dtypes {sorted(kv_dtypes)}")
    state_dtypes = {tuple(dtype_name(d) for d in s.dtypes) for s in states}
    if len(state_dtypes) > 1 or any(len(d) != 2 for d in state_dtypes):
        raise PlanError(
            f"state layers use dtypes {sorted(state_dtypes)}; one (conv, ssm) pair is mapped"
        )
    conv, ssm = next(iter(state_dtypes)) if state_dtypes else (None, None)
    mode = str(cache.mamba_cache_mode)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    draft_tp = getattr(spec_config, "draft_tensor_parallel_size", None) if spec_config else None
    if method == "draft" and draft_tp not in (None, tp):
        # hybridkv shards every model of a plan over one tensor-parallel size
        raise PlanError(
            f"the draft model runs at tensor-parallel size {draft_tp}, the main model at "
            f"{tp}; hybridkv plans both at one size"
        )
    return PlanOptions(
        spec_method=method,
        num_spec_tokens=int(spec_config.num_speculative_tokens) if method else 0,
        kv_dtype=_dtype(kv_dtypes.pop(), "KV cache") if kv_dtypes else None,
        conv_dtype=_dtype(conv, "conv state") if conv else None,
        ssm_dtype=_dtype(ssm, "ssm state") if ssm else None,
        max_model_len=vllm_config.model_config.max_model_len,
        prefix_caching=bool(cache.enable_prefix_caching),
        state_mode=mode if cache.enable_prefix_caching else "none",
        memory_bytes=PLAN_KV_BYTES,
        layout="shared",
        block_align_tokens=align,
        one_group_models=("draft",) if method == "draft" else (),
        # every worker's specs are its tensor-parallel shard (vLLM merges equal ones)
        tp=tp,
    )


def model_specs(vllm_config: Any, method: str | None) -> tuple[Any, Any]:
    from hybridkv.models import load_model_spec

    def spec_of(model_config: Any, what: str) -> Any:
        try:
            return load_model_spec(model_config.hf_config.to_dict())
        except HybridKVError as err:
            raise PlanError(f"hybridkv cannot read the {what} model's config: {err}") from err

    main = spec_of(vllm_config.model_config, "main")
    if method != "draft":
        return main, None
    return main, spec_of(vllm_config.speculative_config.draft_model_config, "draft")


def _group_spec(
    group: Any, names: list[str], specs: dict[str, KVCacheSpec], state_mode: str
) -> KVCacheSpec:
    """One vLLM group spec for hybridkv's group, after checking the page arithmetic."""
    layer_specs: dict[str, KVCacheSpec] = {}
    for name in names:
        spec = specs[name]
        if isinstance(spec, MambaSpec):
            raw = dataclasses.replace(spec, page_size_padded=None).page_size_bytes
            if raw != group.page_bytes:
                raise PlanError(
                    f"layer {name}: vLLM's state page is {raw} bytes, hybridkv's is "
                    f"{group.page_bytes}; the specs disagree (dtypes or speculative rows)"
                )
            padded = group.padded_page_bytes if group.padded_page_bytes > raw else None
            # The state block stays vLLM's: every worker reads it from its own
            # cache_config.mamba_block_size (checkpoint columns, prefill checkpoint
            # grid). In align mode hybridkv's checkpoint interval must be a multiple of
            # it, so every prefix hit hybridkv plans for lands on a saved state.
            if state_mode == "align" and group.block_size % spec.block_size:
                raise PlanError(
                    f"hybridkv checkpoints states every {group.block_size} tokens, not a "
                    f"multiple of vLLM's Mamba block size {spec.block_size}"
                )
            layer_specs[name] = dataclasses.replace(spec, page_size_padded=padded)
        elif isinstance(spec, FullAttentionSpec):
            one = dataclasses.replace(spec, block_size=1, page_size_padded=None)
            if one.page_size_bytes * group.block_size != group.page_bytes:
                raise PlanError(
                    f"layer {name}: vLLM's attention page is {one.page_size_bytes} bytes per "
                    f"token, hybridkv's {group.page_bytes // group.block_size}"
                )
            layer_specs[name] = dataclasses.replace(
                spec, block_size=group.block_size, page_size_padded=None
            )
        else:
            raise PlanError(f"layer {name}: spec {type(spec).__name__} is not mapped")
    merged = UniformTypeKVCacheSpecs.from_specs(layer_specs)
    if merged is None:
        raise PlanError(f"hybridkv's group {group.group_id} mixes layer kinds vLLM cannot merge")
    return merged


def plan_groups(
    vllm_config: Any, specs: dict[str, KVCacheSpec], align: int, layout: Any = None
) -> tuple[list[KVCacheGroupSpec], CachePlan]:
    """hybridkv's plan for vLLM's specs, as vLLM's KV-cache groups; `PlanError` says why
    vLLM's own grouping should stay. ``layout``: vLLM's resolved one when None."""
    _check_supported(
        vllm_config, specs, layout or vllm_config.cache_config.get_resolved_kv_cache_layout()
    )
    options = _options(vllm_config, specs, align)
    main, draft = model_specs(vllm_config, options.spec_method)
    ours = plan(main, draft, options=options)
    if len(ours.pools) != 1:
        raise PlanError(f"hybridkv's plan has {len(ours.pools)} pools; vLLM's workers take one")
    by_key: dict[tuple[str, int], str] = {}
    for name, spec in specs.items():
        key = _layer_key(name, spec)
        if key in by_key:
            raise PlanError(f"vLLM layers {by_key[key]} and {name} map to the same layer {key}")
        by_key[key] = name
    groups: list[KVCacheGroupSpec] = []
    for group in ours.groups:
        names = []
        for ref in group.layers:
            if (ref.model, ref.index) not in by_key:
                raise PlanError(f"hybridkv's layer {ref.name} has no vLLM KV-cache spec")
            names.append(by_key.pop((ref.model, ref.index)))
        spec = _group_spec(group, names, specs, options.resolved_state_mode)
        groups.append(KVCacheGroupSpec(names, spec))
    if by_key:
        raise PlanError(f"vLLM layers {sorted(by_key.values())} are missing from hybridkv's plan")
    return groups, ours


def iter_layer_specs(group: KVCacheGroupSpec) -> list[KVCacheSpec]:
    """One spec per layer of a group (vLLM's group spec may stand for all of them)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec] * len(group.layer_names)


def raw_page_bytes(spec: KVCacheSpec) -> int:
    """A layer's page without vLLM's padding (the bytes its data occupies)."""
    if getattr(spec, "page_size_padded", None) is None:
        return spec.page_size_bytes
    return dataclasses.replace(spec, page_size_padded=None).page_size_bytes  # type: ignore[type-var]


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

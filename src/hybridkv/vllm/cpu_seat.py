"""Where vLLM's CPU platform gets hybridkv's CPU ops (`hybridkv.vllm.cpu_ops`): right
after its own Triton overrides (``CpuPlatform.register_triton_kernel_overrides``, which
vLLM's worker calls once general plugins are loaded), only on vLLM's CPU build and only
when Triton is absent; and the one argument fix its Gated DeltaNet decode op needs with
drafts configured (`unit_stride_indices`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from hybridkv.vllm.cpu_ops import KERNEL_MODULE, KERNELS

logger = logging.getLogger("vllm.hybridkv")

_MARK = "_hybridkv_cpu_ops"


def _param_names(fn: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(getattr(fn, "func", fn)).parameters)


def register_cpu_ops() -> list[str]:
    """Register `KERNELS` with vLLM's dispatcher when Triton is absent; the names newly
    registered. Skips a kernel already overridden (by us: a repeated call, a forked
    worker; or by vLLM itself in a later build, whose version wins) and one whose
    parameters differ from ours (another vLLM's kernel: left alone, one warning)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return []  # Triton runs vLLM's own kernels (Triton-CPU, or a GPU)
    import importlib

    from vllm.triton_utils.dispatcher import KernelOverride, register_kernels

    module = importlib.import_module(KERNEL_MODULE)
    pending: dict[str, Callable[..., None]] = {}
    for name, impl in KERNELS.items():
        current = getattr(module, name.rsplit(".", 1)[1], None)
        if current is None or isinstance(current, KernelOverride):
            continue
        if _param_names(current) != _param_names(impl):
            logger.warning(
                "hybridkv: vLLM's %s takes other parameters than hybridkv's CPU version; "
                "not registered",
                name,
            )
            continue
        pending[name] = impl
    if pending:
        register_kernels(pending)
        logger.info(
            "hybridkv: CPU ops registered for vLLM's state copies with drafts and prefix "
            "caching (%s)",
            ", ".join(n.rsplit(".", 1)[1] for n in pending),
        )
    return list(pending)


_GDN_OP = "fused_sigmoid_gating_delta_rule_update_cpu"


def unit_stride_indices() -> bool:
    """Give vLLM-CPU's Gated DeltaNet decode op state indices with a unit stride; True
    when newly wrapped.

    With drafts configured, a step with exactly one non-draft row of one token (a prompt
    left with one token after a prefix hit, a one-token prefill chunk) hands that op a
    one-element column slice of the state-index table (stride K + 1). vLLM's
    ``.contiguous()`` keeps it (a one-element tensor counts as contiguous) and the op
    refuses it ("tensor must be contiguous at last dimension"), stock vLLM-CPU 0.32 and
    hybridkv's scheduler alike. The copy changes no value."""
    import torch
    from vllm import _custom_ops

    current = getattr(_custom_ops, _GDN_OP, None)
    if current is None or getattr(current, _MARK, False):
        return False

    def with_unit_strides(*args: Any, **kwargs: Any) -> Any:
        indices = kwargs.get("initial_state_indices")
        if isinstance(indices, torch.Tensor) and indices.dim() and indices.stride(-1) != 1:
            fresh = torch.empty_like(indices, memory_format=torch.contiguous_format)
            kwargs["initial_state_indices"] = fresh.copy_(indices)
        return current(*args, **kwargs)

    setattr(with_unit_strides, _MARK, True)
    setattr(_custom_ops, _GDN_OP, with_unit_strides)
    return True


def _wrap_overrides(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def register_triton_kernel_overrides(cls: Any) -> None:
        original(cls)
        register_cpu_ops()
        if unit_stride_indices():
            logger.info("hybridkv: vLLM-CPU's %s gets state indices of unit stride", _GDN_OP)

    setattr(register_triton_kernel_overrides, _MARK, True)
    return register_triton_kernel_overrides


def install_cpu_ops() -> bool:
    """Make vLLM's CPU platform register hybridkv's CPU ops right after its own Triton
    overrides (the worker calls it once general plugins are loaded). Only vLLM's CPU
    build is touched; idempotent (a plugin may load several times per process, and a
    forked process inherits the wrap). True when newly wrapped."""
    from hybridkv.vllm.versions import installed_vllm, is_supported

    found = installed_vllm()
    if found is None or found.distribution != "vllm-cpu" or not is_supported(found):
        return False
    from vllm.platforms.cpu import CpuPlatform

    current = CpuPlatform.__dict__["register_triton_kernel_overrides"].__func__
    if getattr(current, _MARK, False):
        return False
    CpuPlatform.register_triton_kernel_overrides = classmethod(  # type: ignore[method-assign,assignment]
        _wrap_overrides(current)
    )
    return True

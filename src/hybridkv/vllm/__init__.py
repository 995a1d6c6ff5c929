"""hybridkv inside vLLM: a ``vllm.general_plugins`` entry point named ``hybridkv``.

With hybridkv installed beside a supported vLLM, every vLLM process loads `register`
(vLLM's ``VLLM_PLUGINS`` selects plugins as usual: ``VLLM_PLUGINS=hybridkv`` loads only
this one, any list without it leaves vLLM stock). It makes vLLM's hybrid block-size rule
ask hybridkv's planner (`hybridkv.vllm.hooks`). Any other vLLM version: one warning
naming it, and vLLM stays untouched.

Nothing below this package imports it; it imports `hybridkv.plan` and vLLM.
"""

from __future__ import annotations

import logging

from hybridkv.vllm.versions import SUPPORTED, installed_vllm, is_supported

__all__ = ["SUPPORTED", "Scheduler", "installed_vllm", "is_supported", "register"]

logger = logging.getLogger("vllm.hybridkv")


def __getattr__(name: str) -> object:
    """``hybridkv.vllm.Scheduler`` (``--scheduler-cls hybridkv.vllm.Scheduler``), imported
    on first use: it subclasses vLLM's scheduler, so it needs vLLM."""
    if name == "Scheduler":
        from hybridkv.vllm.scheduler import Scheduler

        return Scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """vLLM's plugin entry point; runs in every vLLM process, possibly several times."""
    found = installed_vllm()
    if found is None:
        return
    if not is_supported(found):
        logger.warning(
            "hybridkv: %s %s is not a supported version (%s); vLLM is left untouched",
            found.distribution,
            found.version,
            ", ".join(f"{name} {prefix}x" for name, prefix in SUPPORTED.items()),
        )
        return
    from hybridkv.vllm.hooks import install

    if install():
        logger.info("hybridkv: planning vLLM's KV cache (%s %s)", found.distribution, found.version)

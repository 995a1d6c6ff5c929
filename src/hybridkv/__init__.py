"""hybridkv: KV-cache and recurrent-state planning and management for hybrid LLMs.

Public API: `load_model_spec`, `plan`, `PlanOptions`, `CachePlan`, `CacheManager`,
`simulate`; the torch engine lives in `hybridkv.engine`.
"""

from __future__ import annotations

from typing import Any

from hybridkv.errors import (
    CacheError,
    ConfigError,
    EngineError,
    HybridKVError,
    PlanError,
    SimulationError,
    SpecError,
    TraceError,
)
from hybridkv.plan import CachePlan, PlanOptions, plan
from hybridkv.spec import ModelSpec

__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "CacheManager",
    "CachePlan",
    "ConfigError",
    "EngineError",
    "HybridKVError",
    "ModelSpec",
    "PlanError",
    "PlanOptions",
    "SimulationError",
    "SpecError",
    "TraceError",
    "load_model_spec",
    "plan",
    "simulate",
]


def __getattr__(name: str) -> Any:
    # Lazy imports keep `import hybridkv` light and let the layers be built separately.
    if name == "load_model_spec":
        from hybridkv.models import load_model_spec

        return load_model_spec
    if name == "CacheManager":
        from hybridkv.cache import CacheManager

        return CacheManager
    if name == "simulate":
        from hybridkv.sim import simulate

        return simulate
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")

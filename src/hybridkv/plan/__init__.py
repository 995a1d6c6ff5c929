"""Memory planning: (main, draft, options) -> `CachePlan`."""

from hybridkv.plan.planner import plan
from hybridkv.plan.types import (
    LAYOUTS,
    CachePlan,
    Capacity,
    GroupPlan,
    LayerRef,
    PlanOptions,
    PoolPlan,
    TensorPlacement,
)

__all__ = [
    "LAYOUTS",
    "CachePlan",
    "Capacity",
    "GroupPlan",
    "LayerRef",
    "PlanOptions",
    "PoolPlan",
    "TensorPlacement",
    "plan",
]

"""Simulator: traces, workload generators, a scheduler model and `simulate`.

``simulate(trace, plan)`` replays a JSONL trace (`hybridkv.sim.trace`) through the
engine's own scheduler (`hybridkv.sched`, trace replay in `hybridkv.sim.scheduler`) and the real
`hybridkv.cache.CacheManager`, with a linear step-time clock (`hybridkv.sim.cost`),
and returns a `SimResult` (`hybridkv.sim.metrics`). The scheduler's limits are the
engine's own `SchedulerConfig` (re-exported here). Workloads come from
`hybridkv.sim.workloads`; the CLI commands live in `hybridkv.cli.sim`.
"""

from hybridkv.sched import SchedulerConfig
from hybridkv.sim.cost import StepCost
from hybridkv.sim.metrics import SimResult
from hybridkv.sim.scheduler import ReplayOptions, SimulationError
from hybridkv.sim.simulator import simulate
from hybridkv.sim.trace import TraceRequest, parse_trace, read_trace, write_trace
from hybridkv.sim.workloads import WORKLOADS, WorkloadOptions, generate_workload, workload_options

__all__ = [
    "WORKLOADS",
    "ReplayOptions",
    "SchedulerConfig",
    "SimResult",
    "SimulationError",
    "StepCost",
    "TraceRequest",
    "WorkloadOptions",
    "generate_workload",
    "parse_trace",
    "read_trace",
    "simulate",
    "workload_options",
    "write_trace",
]

"""The engine schedules with the one torch-free scheduler (`hybridkv.sched`); these
names stay importable from here."""

from hybridkv.sched import Request, ScheduledChunk, Scheduler, SchedulerConfig, Status

__all__ = ["Request", "ScheduledChunk", "Scheduler", "SchedulerConfig", "Status"]

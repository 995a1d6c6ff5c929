"""One small hierarchy of typed errors.

Every error raised for something a caller, a config or a trace can trigger is a
`HybridKVError`; its message names the layer / group / field involved, the numbers on
both sides, and what to change. Bare `assert` is reserved for our own invariants.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on purpose."""


class ConfigError(HybridKVError):
    """A model config (config.json or preset) is malformed or unsupported."""


class SpecError(HybridKVError):
    """A layer spec got impossible numbers (zero heads, a dtype we do not know, ...)."""


class PlanError(HybridKVError):
    """The planner cannot satisfy the inputs (memory, block size, layout, max_num_seqs)."""


class CacheError(HybridKVError):
    """A `CacheManager` call that is not valid in the request's current state."""


class InvariantError(HybridKVError):
    """`check_invariants()` found a broken invariant (a bug in hybridkv, never user input)."""


class TraceError(HybridKVError):
    """A simulator trace line is malformed; the message carries the line number."""


class SimulationError(HybridKVError):
    """The simulator cannot make progress (a request that can never fit, a stuck queue)."""


class SchedulerError(HybridKVError):
    """A scheduling call or config that cannot work (a request that can never fit, an
    executor result that contradicts the step it was given)."""


class EngineError(HybridKVError):
    """The reference engine cannot load or run a checkpoint."""


class ServeError(HybridKVError):
    """`hybridkv serve` cannot start (a missing extra, an address in use, bad flags)."""


class RequestError(ServeError):
    """An HTTP API request is invalid. ``param`` names the offending field (None for the
    whole body), ``status`` is the HTTP status to answer with, ``code`` a short
    machine-readable reason (OpenAI's error shape: message, type, param, code)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.kind = kind

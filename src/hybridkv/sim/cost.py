"""A step-time clock: how long one scheduler step takes, with no model compute.

The simulator needs a clock only to decide which requests have arrived and to report
latencies; it never claims to predict a GPU. The model is linear::

    step_s = fixed_s + per_token_s * scheduled tokens + per_seq_s * running requests
             + per_context_token_s * tokens attended (sum of context lengths)

Defaults are the order of magnitude of a small model on one modern GPU (about 8 ms for
a decode step of a few dozen requests, about 60 ms for an 8K-token prefill).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Coefficients of the linear step-time model (seconds)."""

    fixed_s: float = 0.006
    per_token_s: float = 7e-6
    per_seq_s: float = 2e-5
    per_context_token_s: float = 2e-9

    def step_s(self, *, num_tokens: int, num_seqs: int, num_context_tokens: int) -> float:
        """Seconds for one step that schedules ``num_tokens`` over ``num_seqs`` requests."""
        if num_tokens == 0:
            return 0.0
        return (
            self.fixed_s
            + self.per_token_s * num_tokens
            + self.per_seq_s * num_seqs
            + self.per_context_token_s * num_context_tokens
        )

"""Loop detection for the ``chain`` eviction policy: are prefix hits coming back at one
regular reuse distance, as when sessions are served in turn (round robin)?

Distances are counted in *request releases* (one tick per `BlockPool.release_many` of a
request's table), not in blocks: sessions of different lengths then all come back after
the same number of ticks (24 sessions served in turn: 23 other releases), while a count
in blocks grows with the sessions and tells a loop from a finished conversation badly.

The detector keeps moving means of the distance and of its square (weight
``LOOP_WEIGHT`` per sample, one per release and hit pair) and calls the traffic a
loop when, after ``LOOP_MIN_HITS`` samples, the coefficient of variation is below
``LOOP_CV``. Measured at the end of `bench/prefix_policies.py` runs (seed 0): round
robin 0.00 (dense60, 16 GiB) and 0.01 (swa60, 6 GiB); chat 0.56 (4 GiB) and 0.46
(24 GiB, on for 18 of 521 samples; hit rate unchanged);
agentic 0.79 (4 GiB); few-shot 1.05 (2 GiB, on for 1 of 174 samples).
"""

from __future__ import annotations

from hybridkv.errors import InvariantError

LOOP_CV = 0.25  # coefficient of variation of reuse distances below which it is a loop
LOOP_WEIGHT = 0.05  # weight of a new sample in the moving moments
LOOP_MIN_HITS = 4  # samples taken before loop mode may turn on


class LoopDetector:
    """The loop clock of one free queue, the clock at each block's release, moving
    moments of hit distances and the loop verdict."""

    __slots__ = ("clock", "freed", "hits", "loop", "mean", "noted", "square")

    def __init__(self, num_blocks: int) -> None:
        self.clock = 0  # request releases so far (the free queue ticks it)
        self.freed = [0] * num_blocks  # clock at each block's release
        self.mean = 0.0  # moving mean of distances
        self.square = 0.0  # moving mean of their squares
        self.hits = 0  # samples taken
        self.loop = False
        self.noted = (-1, -1)  # (release, hit) clocks of the last sample

    def tick(self) -> int:
        """One request's table was released: the clock moves on; returns it."""
        self.clock += 1
        return self.clock

    def hit(self, block: int) -> None:
        """A prefix hit takes ``block``: one sample per (release, hit) pair of clocks,
        since a chain's blocks all share one distance and would swamp the moments."""
        key = (self.freed[block], self.clock)
        if key != self.noted:
            self.noted = key
            self.note(float(self.clock - key[0]))

    def note(self, distance: float) -> None:
        """A hit came back ``distance`` request releases after its block was freed."""
        if self.hits == 0:
            self.mean, self.square = distance, distance * distance
        else:
            self.mean += LOOP_WEIGHT * (distance - self.mean)
            self.square += LOOP_WEIGHT * (distance * distance - self.square)
        self.hits += 1
        if self.hits >= LOOP_MIN_HITS:
            self.loop = self.variance() < (LOOP_CV * self.mean) ** 2

    def variance(self) -> float:
        return max(0.0, self.square - self.mean * self.mean)

    def check_invariants(self, cached: set[int], *, chain: bool) -> None:
        """No ``cached`` block released after the clock; moments of non-negative
        distances (the square's mean is at least the mean squared: both are the same
        convex combination); loop mode only under ``chain`` and as `note` sets it."""
        late = [b for b in cached if self.freed[b] > self.clock]
        if late:
            raise InvariantError(
                f"loop detector: block {late[0]} released at clock {self.freed[late[0]]}, "
                f"after the clock {self.clock}"
            )
        if self.loop and not chain:
            raise InvariantError("loop detector: loop mode on under the lru policy")
        if self.mean < 0 or self.square < self.mean * self.mean * (1 - 1e-9) - 1e-9:
            raise InvariantError(
                f"loop detector: moments mean {self.mean} and square {self.square} are "
                "not those of non-negative distances"
            )
        regular = self.variance() < (LOOP_CV * self.mean) ** 2
        if self.loop and not (self.hits >= LOOP_MIN_HITS and regular):
            raise InvariantError(
                f"loop detector: loop mode on after {self.hits} samples (needs "
                f"{LOOP_MIN_HITS}) with distance variance {self.variance():.3g} "
                f"(mean {self.mean:.3g}, limit CV {LOOP_CV})"
            )

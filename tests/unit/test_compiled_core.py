"""The two builds of the cache core (setup.py: pure Python by default, mypyc with
``HYBRIDKV_COMPILE=1``) and the per-request call path both builds share.

``HYBRIDKV_EXPECT_COMPILED=1`` (CI's compiled step) says the compiled build must be the
one loaded; unset, the pure-Python sources must be (a stale compiled module left in
``src/`` by an editable compiled install would otherwise be tested silently)."""

from __future__ import annotations

import importlib
import os
import random
from importlib.machinery import EXTENSION_SUFFIXES

import numpy as np
import pytest

import hybridkv.cache
from hybridkv.cache import NO_CHANGE, CacheManager
from hybridkv.cache.managers import UNBOUNDED
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.cache.validate import FAST_MAX_COUNT
from hybridkv.errors import CacheError

# the modules setup.py compiles that a manager step runs through
CORE_MODULES = (
    "hybridkv.cache.block_pool",
    "hybridkv.cache.coordinator",
    "hybridkv.cache.free_queue",
    "hybridkv.cache.hashing",
    "hybridkv.cache.manager",
    "hybridkv.cache.managers.full",
    "hybridkv.cache.managers.state",
    "hybridkv.cache.request",
    "hybridkv.cache.step_paths",
    "hybridkv.cache.validate",
)


def _is_extension(module: str) -> bool:
    path = importlib.import_module(module).__file__ or ""
    return path.endswith(tuple(EXTENSION_SUFFIXES))


def test_the_loaded_build_is_the_expected_one() -> None:
    expected = os.environ.get("HYBRIDKV_EXPECT_COMPILED", "0") == "1"
    assert hybridkv.cache.COMPILED is expected, (
        f"hybridkv.cache.COMPILED is {hybridkv.cache.COMPILED} but HYBRIDKV_EXPECT_COMPILED "
        f"says {expected} ({hybridkv.cache.__file__}); a pure run that loads compiled modules "
        "has stale ones in src/: reinstall without HYBRIDKV_COMPILE (setup.py removes them)"
    )
    # all or nothing: a half-compiled core would mix the builds
    assert {_is_extension(m) for m in CORE_MODULES} == {expected}


def _prompt(i: int) -> list[int]:
    return [1 + (i * 7 + t) % 50 for t in range(11 + i % 9)]


def _replay(per_request: bool, seed: int) -> list[object]:
    """A random life of six requests (drafts, accepts, preemptions) through one call
    per request or one batch per step; the observable state after each step."""
    plan = toy_plan([ToyGroup("full", 4), ToyGroup("state", 8)], num_blocks=160, num_spec_tokens=3)
    cm = CacheManager(plan, record_events=False)
    rng = random.Random(seed)
    running = []
    for i in range(6):
        req = f"r{i}"
        cm.add_request(req, _prompt(i))
        cm.lookup(req)
        assert cm.allocate(req, len(_prompt(i)) - cm.num_computed_tokens(req)) is not None
        cm.commit(req, 0, [3])
        running.append(req)
    seen: list[object] = []
    for _ in range(40):
        drafts = [rng.randrange(0, 4) for _ in running]
        if per_request:
            deltas = [cm.allocate(r, 1, d) for r, d in zip(running, drafts, strict=True)]
        else:
            deltas = cm.allocate_batch(running, [1] * len(running), drafts)
        assert None not in deltas
        accepted = [rng.randrange(0, d + 1) for d in drafts]
        new = [[rng.randrange(0, 50) for _ in range(a + 1)] for a in accepted]
        if per_request:
            for r, a, ids in zip(running, accepted, new, strict=True):
                cm.commit(r, a, ids)
        else:
            cm.commit_batch(running, accepted, new)
        cm.check_invariants()
        seen.append([d is NO_CHANGE for d in deltas])
        seen.append({r: (cm.num_computed_tokens(r), cm.block_tables(r)) for r in running})
        if rng.random() < 0.1:
            victim = running[rng.randrange(len(running))]
            cm.preempt(victim)
            hit = cm.lookup(victim)
            assert cm.allocate(victim, len(cm.token_ids(victim)) - hit) is not None
            cm.commit(victim, 0, [4])
    seen.append(cm.stats())
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_request_calls_decide_as_the_batch_calls(seed: int) -> None:
    assert _replay(True, seed) == _replay(False, seed)


def _one_running() -> CacheManager:
    cm = CacheManager(toy_plan([ToyGroup("full", 4)], num_blocks=16))
    cm.add_request("a", [1, 2, 3, 4, 5])
    cm.lookup("a")
    cm.allocate("a", 5, 2)
    return cm


@pytest.mark.parametrize(
    ("accepted", "new", "message"),
    [
        (3, [1, 2, 3, 4], r"3 accepted tokens but 2 were reserved as lookahead"),
        (True, [1], r"num_accepted_tokens must be a non-negative int, got bool"),
        (1.0, [1], r"num_accepted_tokens must be a non-negative int, got float"),
        (-1, [1], r"num_accepted_tokens=-1 must be in \[0, 2\^63\)"),
        (0, [1, -2], r"new_token_ids\[1\] = -2 is outside"),
        (0, [1, 2.5], r"new_token_ids\[1\] is float"),
        (0, "ab", r"new_token_ids must be a sequence of token ids"),
        (2, [1], r"7 computed tokens would exceed 5 \+ 1 verified tokens"),
    ],
)
def test_a_refused_per_request_commit_names_the_problem_and_changes_nothing(
    accepted: object, new: object, message: str
) -> None:
    cm = _one_running()
    with pytest.raises(CacheError, match=message):
        cm.commit("a", accepted, new)  # type: ignore[arg-type]
    assert cm.token_ids("a") == [1, 2, 3, 4, 5] and cm.num_computed_tokens("a") == 0
    cm.commit("a", 1, [6, 7])  # the step is still pending: a valid commit settles it
    assert cm.num_computed_tokens("a") == 6
    cm.check_invariants()


def test_numpy_counts_and_token_arrays_take_the_checked_per_request_path() -> None:
    cm = _one_running()
    cm.commit("a", np.int64(1), np.array([6, 7]))  # type: ignore[arg-type]
    assert cm.num_computed_tokens("a") == 6 and cm.token_ids("a")[-2:] == [6, 7]
    assert cm.allocate("a", np.int32(1), np.int64(0)) is not None  # type: ignore[arg-type]
    cm.commit("a", 0, (8,))
    assert cm.num_computed_tokens("a") == 7


def test_fast_path_bounds_fit_the_compiled_builds_unboxed_ints() -> None:
    """The fast paths compare counts with `UNBOUNDED` and `FAST_MAX_COUNT` at every step:
    both must fit mypyc's short ints (63-bit signed: up to 2^62 - 1), or each compare in
    the compiled build is a generic call on a boxed int (2^62 and 2^63 - 1 were until
    the seventeenth session: 6% of a trace's allocate and commit instructions)."""
    short_max = (1 << 62) - 1
    assert max(UNBOUNDED, FAST_MAX_COUNT) <= short_max
    assert UNBOUNDED >= FAST_MAX_COUNT  # no real count reaches either


@pytest.mark.parametrize("groups", ["full", "full+state"])
@pytest.mark.parametrize("count", [(1 << 62) - 2, (1 << 62) - 1, 1 << 62, (1 << 63) - 1])
def test_counts_on_either_side_of_the_fast_bound_get_the_same_answer(
    groups: str, count: int
) -> None:
    """A count past `FAST_MAX_COUNT` (still valid up to 2^63 - 1) skips the fast path;
    the checked path answers as it does just below it."""
    toy = [ToyGroup("full", 4)] + ([ToyGroup("state", 4)] if groups == "full+state" else [])
    cm = CacheManager(toy_plan(toy, num_blocks=16))
    cm.add_request("a", list(range(1, 10)))
    cm.lookup("a")
    cm.allocate("a", 8)
    cm.commit("a", 0, [])
    with pytest.raises(CacheError, match=f"8 computed \\+ {count} new tokens exceed its 9"):
        cm.allocate("a", count)
    assert cm.allocate("a", 1, count) is None  # that many draft slots never fit
    cm.check_invariants()

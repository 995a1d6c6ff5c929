"""Cache-manager time over whole request lives, hybridkv against vLLM 0.33's own manager.

Question: per scheduled request-step, how long does the cache manager take when it
serves a realistic trace from arrival to finish -- and is that work the same work on
both sides?

One deterministic trace per config (``--num-requests`` requests, 8 prompt families with
shared prefixes, arrivals over time, up to ``--max-running`` at once, chunked prefill
under a token budget, decode steps with 0..K drafts and 0..d accepted), replayed by the
same scheduler loop (`_trace_loop.py`) through each manager; only manager calls are
timed, in process CPU time (the machine may be shared): admission (request creation /
prompt hashing, lookup, first allocate), allocate, commit (accept drafts, append
tokens, cache full blocks), free. vLLM runs in
its own venv (the first of `VLLM_PYTHONS` that exists, or ``--vllm-python``) via
``_vllm_driver.py``, with its scheduler's per-request calls; without it the table shows
hybridkv only and says so.

Our side runs in worker processes (``--worker``), one per build and rep: the pure-Python
sources of this checkout, and the compiled core (``--compiled-path``, default
``build/compiled``, built by ``HYBRIDKV_COMPILE=1 pip install --no-build-isolation
--no-deps --target build/compiled .``; see setup.py). Each worker runs both policies
(``vllm``: LRU eviction and no extra checkpoint rule, the same decisions as vLLM, equal
work; ``ours``: the defaults, chain eviction + junction + turn_end, which change hits and
so the work) with both call styles (``per-request``: one `allocate` / `commit` per
request-step, as vLLM's scheduler calls its manager; ``batched``: `allocate_batch` /
`commit_batch`). The order of the builds alternates from rep to rep.

Pools: each side is first run on a large pool to measure its peak of blocks in use,
then every timed run gets the smallest of ``peak * (1 + slack * 2^i)`` blocks whose run
does exactly the work of the large pool and evicts: tight enough that cached blocks are
evicted on both sides, loose enough that no allocation fails and no hit is lost (either
would change the work). The work counters of both sides
(steps, request-steps, tokens, drafts, hit tokens, allocate calls, evictions) are
printed so that anyone can see the work was equal. ``--reps`` alternating repetitions
(ours, vLLM, ours, ...); medians with the range, and the ratio of each back-to-back pair
(median [range]), which the host's drift over minutes affects less.

Floor: unit costs measured here (a fast-path call of a few int comparisons, one
block's take/append/release, sha256 of one hash unit) times the work counters: what a
pure-Python manager doing the same work cannot go below.

Configs: ``full``: qwen3-4b, block 16. ``hybrid``: 8 full + 16 sliding (W 1024) + 24
Gated DeltaNet (align) main layers and a Qwen3-0.6B-like dense draft, K drafts, in the
``vllm`` layout (the block size vLLM's rule gives; the groups are vLLM's).

    python bench/manager_step.py [--num-requests 768] [--max-running 256] [--reps 5]
                                 [--configs full,hybrid] [--policies vllm,ours]
                                 [--builds pure,compiled] [--no-vllm] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trace_loop import run
from hybridkv.cache import NO_CHANGE, CacheManager, StepDelta
from hybridkv.cache.coordinator import hash_unit_tokens
from hybridkv.models import load_model_spec
from hybridkv.plan import PlanOptions, plan
from hybridkv.plan.types import CachePlan
from hybridkv.spec import (
    AttentionSpec,
    GatedDeltaNetSpec,
    ModelSpec,
    SlidingWindowSpec,
)

HERE = Path(__file__).resolve().parent
# vLLM 0.33 in its own venv: CI's (scripts/install_vllm033.sh), then older places
VLLM_PYTHONS = (
    str(HERE.parent / ".venv-vllm033" / "bin" / "python"),
    "/work/vllm-venv/bin/python",
)
MAX_MODEL_LEN = 16384
LARGE_POOL_BYTES = 2 << 40  # sizing runs only: nothing is evicted


def hybrid_specs() -> tuple[ModelSpec, ModelSpec]:
    full = AttentionSpec(num_kv_heads=4, head_dim=256)
    swa = SlidingWindowSpec(num_kv_heads=4, head_dim=256, sliding_window=1024)
    gdn = GatedDeltaNetSpec(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    )
    main = ModelSpec(
        name="hybrid-8f-16swa-24gdn",
        model_type="hybrid",
        layers=(full,) * 8 + (swa,) * 16 + (gdn,) * 24,
        max_position_embeddings=32768,
    )
    draft = ModelSpec(
        name="qwen3-0.6b-like",
        model_type="qwen3",
        layers=(AttentionSpec(num_kv_heads=8, head_dim=128),) * 28,
        max_position_embeddings=32768,
    )
    return main, draft


def build_plan(name: str, k: int) -> CachePlan:
    opts = {"memory_bytes": LARGE_POOL_BYTES, "max_model_len": MAX_MODEL_LEN}
    if name == "full":
        return plan(load_model_spec("qwen3-4b"), None, PlanOptions(block_size=16, **opts))
    main, draft = hybrid_specs()
    return plan(
        main, draft, PlanOptions(spec_method="draft", num_spec_tokens=k, layout="vllm", **opts)
    )


def with_pool_blocks(cache_plan: CachePlan, num_blocks: int) -> CachePlan:
    """The same plan with ``num_blocks`` usable blocks in its (single) pool."""
    if len(cache_plan.pools) != 1:
        raise SystemExit("the benchmark sizes single-pool plans only")
    pool = dataclasses.replace(cache_plan.pools[0], num_pages=num_blocks + 1)
    return dataclasses.replace(cache_plan, pools=(pool,))


def make_trace(
    num_requests: int, k: int, block: int, max_running: int, seed: int
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32000, int(rng.integers(512, 1536))).tolist() for _ in range(8)]
    family = [int(rng.integers(0, 8)) for _ in range(num_requests)]
    prompts = [
        prefixes[f] + rng.integers(0, 32000, int(rng.integers(256, 1024))).tolist() for f in family
    ]
    drafts, outputs = [], []
    for _ in range(num_requests):
        num_decodes = int(rng.integers(16, 96))
        d = rng.integers(0, k + 1, num_decodes)
        a = (rng.random(num_decodes) * (d + 1)).astype(int)
        drafts.append([[int(x), int(y)] for x, y in zip(d, a, strict=True)])
        outputs.append(rng.integers(0, 32000, int((a + 1).sum()) + k + 10).tolist())
    return {
        "prompts": prompts,
        "outputs": outputs,
        "drafts": drafts,
        "family": family,
        "junction": [len(prefixes[f]) // block * block for f in family],
        "arrival_step": [i // 6 for i in range(num_requests)],
        "block": block,
        "budget": 8192,
        "max_running": max_running,
    }


POLICIES = {
    # vLLM's policies on our side: LRU eviction, no extra checkpoint rule, so that a
    # tight pool evicts the same blocks on both sides and the work stays equal
    "vllm": {"eviction_policy": "lru", "checkpoint_rules": ()},
    # our defaults (`CacheManager`'s): chain eviction, junction + turn_end checkpoints
    "ours": {},
}
POLICY_LABELS = {"vllm": "vLLM's policies", "ours": "our defaults"}


class OursAdapter:
    """`_trace_loop.Adapter` over `CacheManager`. ``per_request``: one `allocate` /
    `commit` call per request-step, as vLLM's scheduler calls its manager; else one
    `allocate_batch` / `commit_batch` per batch."""

    def __init__(
        self,
        cache_plan: CachePlan,
        track_peak: bool = False,
        policy: str = "vllm",
        per_request: bool = False,
    ) -> None:
        self.cm = CacheManager(cache_plan, record_events=False, **POLICIES[policy])
        self.ids: dict[int, str] = {}
        self.num_allocations = 0
        self.blocks_taken = 0
        self.peak_used = 0
        self.track_peak = track_peak
        self.per_request = per_request
        self.sub_timers = {"add": 0.0, "lookup": 0.0, "first_allocate": 0.0}

    def _track(self) -> None:
        used = sum(p.num_usable - p.num_free for p in self.cm.coordinator.pools)
        self.peak_used = max(self.peak_used, used)

    def admit(self, index: int, prompt: list[int], chunk: Callable[[int], int]) -> int | None:
        req = self.ids[index] = f"r{index}"
        cm, clock, sub = self.cm, time.process_time, self.sub_timers
        t0 = clock()
        cm.add_request(req, prompt)
        t1 = clock()
        hit = cm.lookup(req)  # hashes the prompt
        n = chunk(hit)
        t2 = clock()
        delta = cm.allocate(req, n)
        t3 = clock()
        sub["add"] += t1 - t0
        sub["lookup"] += t2 - t1
        sub["first_allocate"] += t3 - t2
        self.num_allocations += 1
        if delta is None:
            return None
        if self.track_peak:  # sizing runs only (`_count`)
            self._count([delta])
            self._track()
        return hit

    def allocate(self, items: list[tuple[int, int, int]]) -> bool:
        if not items:
            return True
        ids = self.ids
        self.num_allocations += len(items)
        if self.per_request:
            allocate = self.cm.allocate
            results = [allocate(ids[i], n, d) for i, n, d in items]
        else:
            indexes, num_new, num_drafts = zip(*items, strict=True)
            results = self.cm.allocate_batch([ids[i] for i in indexes], num_new, num_drafts)
        if None in results:
            return False
        if self.track_peak:
            self._count(results)
            self._track()
        return True

    def _count(self, deltas: list[StepDelta | None]) -> None:
        """Blocks the pools handed out, in sizing runs only: timed runs do no benchmark
        bookkeeping the vLLM driver lacks; `_run_config` copies the count of the sizing
        run at the timed pool size (same trace, same pool, same work)."""
        for delta in deltas:
            if delta is not None and delta is not NO_CHANGE:
                self.blocks_taken += sum(map(len, delta.taken.values()))

    def commit(self, items: list[tuple[int, int, int, list[int]]]) -> None:
        if items:
            ids = self.ids
            if self.per_request:
                commit = self.cm.commit
                for i, _, accepted, new in items:
                    commit(ids[i], accepted, new)
            else:
                indexes, _, accepted_counts, news = zip(*items, strict=True)
                self.cm.commit_batch([ids[i] for i in indexes], accepted_counts, news)
            if self.track_peak:
                self._track()

    def free(self, indexes: list[int]) -> None:
        ids, free = self.ids, self.cm.free
        for i in indexes:
            free(ids.pop(i))


def run_ours(
    cache_plan: CachePlan,
    trace: dict[str, Any],
    track_peak: bool = False,
    policy: str = "vllm",
    per_request: bool = False,
) -> dict:
    adapter = OursAdapter(cache_plan, track_peak, policy, per_request)
    result = run(trace, adapter)
    adapter.cm.check_invariants()
    stats = adapter.cm.stats()
    result["counts"]["allocate_calls"] = adapter.num_allocations
    result["evictions"] = stats.num_evictions
    result["blocks_taken"] = adapter.blocks_taken
    result["blocks_stored"] = stats.num_blocks_stored
    result["peak_used_blocks"] = adapter.peak_used
    return result


# One worker process per build and rep runs every (policy, call style) of ours, so that
# the pure and compiled builds are timed in the same way (``--worker``, below).
STYLES = (("per-request", True), ("batched", False))


def worker(spec_path: str) -> None:
    """Run our side for each (policy, style) of the spec; print one JSON line."""
    import hybridkv.cache

    with open(spec_path) as handle:
        spec = json.load(handle)
    if spec["compiled"] != hybridkv.cache.COMPILED:
        raise SystemExit(
            f"worker expected the {'compiled' if spec['compiled'] else 'pure-Python'} build "
            f"but loaded {hybridkv.cache.__file__} (COMPILED={hybridkv.cache.COMPILED})"
        )
    big = build_plan(spec["config"], spec["k"])
    out = {}
    for policy, num_blocks in spec["pools"].items():
        for style, per_request in STYLES:
            result = run_ours(
                with_pool_blocks(big, num_blocks), spec["trace"], False, policy, per_request
            )
            out[f"{policy}/{style}"] = result
    print(json.dumps(out))


def run_worker(
    build: str, compiled_path: Path, config: str, k: int, pools: dict[str, int], trace: dict
) -> dict:
    """Our side in a fresh process: ``build`` pure (the checkout's sources) or compiled
    (``compiled_path``, see setup.py)."""
    root = compiled_path if build == "compiled" else HERE.parent / "src"
    spec = {
        "config": config,
        "k": k,
        "pools": pools,
        "trace": trace,
        "compiled": build == "compiled",
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", handle.name],
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
        )
    finally:
        os.unlink(handle.name)
    if proc.returncode != 0:
        raise SystemExit(f"{build} worker failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vllm_groups(cache_plan: CachePlan, k: int) -> list[dict]:
    groups = []
    for g in cache_plan.groups:
        spec = g.spec
        entry: dict[str, Any] = {"kind": g.kind, "block_size": g.block_size, "num_spec": k}
        if isinstance(spec, AttentionSpec):
            entry.update(num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
        if isinstance(spec, SlidingWindowSpec):
            entry["sliding_window"] = spec.sliding_window
        groups.append(entry)
    return groups


def run_vllm(
    python: str, groups: list[dict], num_blocks: int, trace: dict, measure_peak: bool = False
) -> dict | None:
    spec = {
        "trace": trace,
        "groups": groups,
        "num_blocks": num_blocks + 1,  # + vLLM's null block
        "max_model_len": MAX_MODEL_LEN,
        "measure_peak": measure_peak,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        proc = subprocess.run(
            [python, str(HERE / "_vllm_driver.py"), handle.name],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
    finally:
        os.unlink(handle.name)
    if proc.returncode != 0:
        Console(stderr=True).print(f"[yellow]vLLM driver failed:[/yellow] {proc.stderr[-3000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- the floor
class _FastCall:
    """The least a request's step can cost: compare a counter, then append tokens."""

    __slots__ = ("limit", "n", "pending", "tokens")

    def __init__(self) -> None:
        self.limit, self.n, self.pending = 1 << 40, 0, False
        self.tokens = array("q")

    def step(self, n: int, lookahead: int) -> bool:
        if not self.pending and self.n + n + lookahead <= self.limit and lookahead >= 0:
            self.pending = True
            self.n += n
            return True
        return False

    def settle(self, new: list[int]) -> None:
        self.pending = False
        self.tokens.extend(new)


def _per_call_seconds(fn: Callable[[], None], number: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best / number


def unit_costs(unit_tokens: int) -> dict[str, float]:
    """Seconds per request-step call pair, block life, index operation and hashed unit
    (min of 5 runs of 100k each)."""
    number = 100_000
    requests = {f"r{i}": _FastCall() for i in range(256)}

    def calls() -> None:
        get, new = requests.get, [5, 6]
        for _ in range(number):
            get("r7").step(1, 3)  # type: ignore[union-attr]
            get("r7").settle(new)  # type: ignore[union-attr]
        requests["r7"].tokens = array("q")

    free = list(range(number))
    table: list[int] = []

    def block_life() -> None:
        pop, append, back = free.pop, table.append, free.append
        for _ in range(number):
            append(pop())
        for b in reversed(table):
            back(b)
        table.clear()

    keys = [sha256(i.to_bytes(8, "little")).digest() for i in range(number)]
    index: dict[bytes, int] = {}

    def index_ops() -> None:  # one insert, one hit, one delete per key: / 3 below
        for i, key in enumerate(keys):
            index[key] = i
        get = index.get
        for key in keys:
            get(key)
        for key in keys:
            del index[key]

    parent = sha256(b"root").digest()
    payload = bytes(8 * unit_tokens)
    empty = sha256()

    def hashing() -> None:  # the cheapest form: copy an empty context, as hybridkv does
        p, fresh = parent, empty.copy
        for _ in range(number // 10):
            h = fresh()
            h.update(p + payload)
            p = h.digest()

    return {
        "call_pair": _per_call_seconds(calls, number),
        "block": _per_call_seconds(block_life, number),
        "index_op": _per_call_seconds(index_ops, 3 * number),
        "unit_hash": _per_call_seconds(hashing, number // 10),
    }


FLOOR_NOTE = (
    "floor = a pure-Python lower bound for the same work: per request-step two dict "
    "lookups by id, a counter compare and a token append; per block taken one block "
    "life (pop, append, push back); per block stored, evicted or hit one dict "
    "operation; sha256 of every hashed unit (prompt at lookup, output at commit). "
    "Excludes the adapter's batch lists, which both sides' times include."
)


def floor_us(
    result: dict, costs: dict[str, float], unit: int, inv_blocks: float
) -> tuple[float, float]:
    """(whole trace, decode) floor in us per request-step / decode request-step
    (see `FLOOR_NOTE`). ``inv_blocks``: sum of 1 / block size over token groups."""
    counts = result["counts"]
    hashed_units = (counts["tokens"] + counts["hit_tokens"]) / unit
    index_ops = result["blocks_stored"] + result["evictions"] + counts["hit_tokens"] * inv_blocks
    total = (
        counts["request_steps"] * costs["call_pair"]
        + result["blocks_taken"] * costs["block"]
        + index_ops * costs["index_op"]
        + hashed_units * costs["unit_hash"]
    )
    tokens_per_decode = counts["decode_tokens"] / max(counts["decode_request_steps"], 1)
    per_decode = (
        costs["call_pair"]
        + tokens_per_decode / unit * costs["unit_hash"]
        + tokens_per_decode * inv_blocks * (costs["block"] + costs["index_op"])
    )
    return total / counts["request_steps"] * 1e6, per_decode * 1e6


COUNTER_KEYS = [
    "steps",
    "request_steps",
    "decode_request_steps",
    "tokens",
    "draft_tokens",
    "hit_tokens",
    "admissions",
    "allocate_calls",
    "commit_items",
]


def _columns() -> list[tuple[str, Callable[[dict], float]]]:
    def per(timer: str, count: str) -> Callable[[dict], float]:
        def value(r: dict) -> float:
            seconds = r["timers"][timer] if timer in r["timers"] else r["sub_timers"][timer]
            return seconds / max(r["counts"][count], 1) * 1e6

        return value

    def per_lookup(r: dict) -> float:  # prompt hashing + lookup (vLLM hashes at add)
        sub = r["sub_timers"]
        return (sub["add"] + sub["lookup"]) / max(r["counts"]["admissions"], 1) * 1e6

    return [
        ("request-step", per("total", "request_steps")),
        ("decode step", per("decode", "decode_request_steps")),
        ("admission", per("admit", "admissions")),
        ("hash+lookup", per_lookup),
        ("first alloc", per("first_allocate", "admissions")),
        ("allocate", per("allocate", "allocate_items")),
        ("commit", per("commit", "commit_items")),
        ("free", per("free", "admissions")),
    ]


def _report(
    console: Console,
    name: str,
    cache_plan: CachePlan,
    block: int,
    args: argparse.Namespace,
    rows: dict[str, list[dict]],
    ref: list[dict],
    check: dict | None,
    costs: dict[str, float],
    unit: int,
) -> None:
    """``rows``: label -> our runs (one per rep, alternating with ``ref``, vLLM's)."""
    columns = _columns()
    step_fn, decode_fn = columns[0][1], columns[1][1]
    inv_blocks = sum(1 / g.block_size for g in cache_plan.groups if not g.is_state)
    first = next(iter(rows.values()))
    floor_total, floor_decode = floor_us(first[0], costs, unit, inv_blocks)
    title = (
        f"{name}: {len(cache_plan.groups)} groups, block {block}, {args.num_requests} requests "
        f"({args.max_running} at once), drafts 0..{args.max_drafts}, {args.reps} alternating "
        "reps; us per call (per request-step, decode request-step, admitted request, "
        "running allocate, commit, freed request): median \\[min-max], parts median; vLLM / "
        "row: the ratio of medians, and per pair (run i of the row against vLLM's run i, "
        "back to back)"
    )
    table = Table(title=title)
    table.add_column("manager (build, policies, calls)")
    for col, _ in columns:
        table.add_column(col, justify="right")
    table.add_column("vLLM / row: step", justify="right")
    table.add_column("per pair", justify="right")
    table.add_column("decode / floor", justify="right")
    all_rows = ([("vLLM 0.33 (its scheduler's per-request calls)", ref)] if ref else []) + list(
        rows.items()
    )
    for label, runs in all_rows:
        # the range for the two headline columns; medians for the parts
        cells = [
            _fmt(values) if i < 2 else f"{statistics.median(values):.2f}"
            for i, values in enumerate([fn(r) for r in runs] for _, fn in columns)
        ]
        ratio = paired = "-"
        if ref and runs is not ref:
            mine = statistics.median(step_fn(r) for r in runs)
            ratio = f"{statistics.median(step_fn(r) for r in ref) / mine:.2f}x"
            paired = _fmt([step_fn(b) / step_fn(a) for a, b in zip(runs, ref, strict=False)], "x")
        decode = statistics.median(decode_fn(r) for r in runs) / floor_decode
        table.add_row(label, *cells, ratio, paired, f"{decode:.1f}x")
    table.add_row(
        "pure-Python floor",
        f"{floor_total:.2f}",
        f"{floor_decode:.2f}",
        *["-"] * (len(columns) + 1),
    )
    console.print(table)
    counters = Table(
        title=f"{name}: work counters per policy (equal work: vLLM's policies must match "
        "vLLM's row; our defaults change hits, so steps and tokens may differ)"
    )
    counters.add_column("side")
    for key in [*COUNTER_KEYS, "evictions"]:
        counters.add_column(key.replace("_", " "), justify="right")
    shown: set[str] = set()
    for label, runs in rows.items():
        policy = label.split(", ")[1]
        if policy in shown:
            continue
        shown.add(policy)
        r = runs[0]
        counters.add_row(
            f"hybridkv, {policy}",
            *[str(r["counts"][key]) for key in COUNTER_KEYS],
            str(r["evictions"]),
        )
        same = all(runs[i]["counts"] == runs[0]["counts"] for i in range(len(runs))) and all(
            o[0]["counts"] == r["counts"] for lab, o in rows.items() if policy in lab
        )
        if not same:
            console.print(f"[red]{policy}: the work differs between builds or call styles[/red]")
        if (
            ref
            and policy == POLICY_LABELS["vllm"]
            and any(ref[0]["counts"][key] != r["counts"][key] for key in COUNTER_KEYS[:7])
        ):
            console.print("[red]the work differs between vLLM and ours: see the counters[/red]")
    if ref:
        evictions = "?" if check is None else str(check["evictions"])
        counters.add_row(
            "vLLM 0.33", *[str(ref[0]["counts"][key]) for key in COUNTER_KEYS], evictions
        )
    console.print(counters)
    console.print(
        f"unit costs: call pair {costs['call_pair'] * 1e6:.3f} us, block life "
        f"{costs['block'] * 1e6:.3f} us, index op {costs['index_op'] * 1e6:.3f} us, sha256 "
        f"of a {unit}-token unit {costs['unit_hash'] * 1e6:.3f} us. {FLOOR_NOTE} The floor is "
        "computed from the first row's counters."
    )


# ---------------------------------------------------------------------- main
def _fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.2f}{unit} [{min(values):.2f}-{max(values):.2f}]"


def _tight_pool(sizing: dict, attempt: Callable[[int], dict | None], slack: float) -> int:
    """Smallest of peak * (1 + slack * 2^i), i = 0..4, whose run does the same work as
    on a large pool (same counters: evictions must not cost a hit) and evicts; else the
    smallest that does the same work (small traces may never evict)."""
    peak = sizing["peak_used_blocks"]
    equal: int | None = None
    for i in range(5):
        blocks = int(peak * (1 + slack * 2**i)) + 1
        try:
            result = attempt(blocks)
        except SystemExit:
            continue
        if result and result["counts"] == sizing["counts"]:
            if result.get("evictions"):
                return blocks
            equal = blocks if equal is None else equal
    if equal is None:
        raise SystemExit(f"no pool between {peak} and {blocks} blocks keeps the work equal")
    Console(stderr=True).print(f"[yellow]no eviction at equal work; pool {equal} blocks[/yellow]")
    return equal


def _run_config(
    name: str,
    args: argparse.Namespace,
    vllm_python: str | None,
    builds: list[str],
    console: Console,
) -> None:
    k = args.max_drafts
    big = build_plan(name, k)
    block = max(g.block_size for g in big.groups)
    unit = hash_unit_tokens(big)
    trace = make_trace(args.num_requests, k, block, args.max_running, args.seed)
    pools: dict[str, int] = {}
    peaks: dict[str, int] = {}
    checked: dict[tuple[str, int], dict] = {}  # (policy, pool blocks) -> a sizing run

    def attempt(blocks: int, policy: str) -> dict:
        out = run_ours(with_pool_blocks(big, blocks), trace, track_peak=True, policy=policy)
        checked[(policy, blocks)] = out
        return out

    for policy in args.policies:
        sizing = run_ours(big, trace, track_peak=True, policy=policy)
        peaks[policy] = sizing["peak_used_blocks"]
        pools[policy] = _tight_pool(sizing, lambda blocks, p=policy: attempt(blocks, p), args.slack)
    groups = vllm_groups(big, k)
    vllm_blocks = None
    check = None
    vsizing: dict = {}
    if vllm_python:
        vsizing = run_vllm(vllm_python, groups, 1 << 22, trace, measure_peak=True) or {}
        if vsizing:
            vllm_blocks = _tight_pool(
                vsizing,
                lambda blocks: run_vllm(vllm_python, groups, blocks, trace, measure_peak=True),
                args.slack,
            )
            check = run_vllm(vllm_python, groups, vllm_blocks, trace, measure_peak=True)
    rows: dict[str, list[dict]] = {}
    vllm_runs: list[dict] = []
    for rep in range(args.reps):
        # alternate the order of the builds from rep to rep; vLLM runs between them
        order = builds if rep % 2 == 0 else builds[::-1]
        for i, build in enumerate(order):
            out = run_worker(build, args.compiled_path, name, k, pools, trace)
            for key, result in out.items():
                policy, style = key.split("/")
                # counted untimed, at this pool size (`OursAdapter._count`)
                result["blocks_taken"] = checked[(policy, pools[policy])]["blocks_taken"]
                label = f"hybridkv {build}, {POLICY_LABELS[policy]}, {style}"
                rows.setdefault(label, []).append(result)
            if i == 0 and vllm_blocks is not None and vllm_python:
                ref = run_vllm(vllm_python, groups, vllm_blocks, trace)
                if ref is not None:
                    vllm_runs.append(ref)
    costs = unit_costs(unit)
    ordered = dict(sorted(rows.items(), key=lambda item: _row_order(item[0], builds)))
    _report(console, name, big, block, args, ordered, vllm_runs, check, costs, unit)
    console.print(
        "pools: hybridkv "
        + ", ".join(f"{POLICY_LABELS[p]} {pools[p]} blocks (peak in use {peaks[p]})" for p in pools)
        + "; "
        + (
            f"vLLM {vllm_blocks} blocks (peak in use {vsizing['peak_used_blocks']})"
            if vllm_blocks
            else "vLLM absent"
        )
    )


def _row_order(label: str, builds: list[str]) -> tuple[int, int, int]:
    build = next(i for i, b in enumerate(builds) if f" {b}," in label)
    policy = 0 if POLICY_LABELS["ours"] in label else 1
    return (policy, build, 0 if "per-request" in label else 1)


def _vllm_python(given: str | None) -> str | None:
    """``--vllm-python``, else the first of `VLLM_PYTHONS` that exists."""
    if given:
        return given if Path(given).exists() else None
    return next((p for p in VLLM_PYTHONS if Path(p).exists()), None)


def _builds(args: argparse.Namespace, console: Console) -> list[str]:
    builds = args.builds.split(",")
    if "compiled" in builds and not (args.compiled_path / "hybridkv" / "cache").is_dir():
        console.print(
            f"[yellow]no compiled build at {args.compiled_path}: pure Python only (build it: "
            "HYBRIDKV_COMPILE=1 pip install --no-build-isolation --no-deps --target "
            "build/compiled .)[/yellow]"
        )
        builds.remove("compiled")
    return builds


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=768)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-drafts", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--slack", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="full,hybrid")
    parser.add_argument("--policies", default="vllm,ours", help="vllm (LRU, no extra rule), ours")
    parser.add_argument("--builds", default="pure,compiled")
    parser.add_argument("--compiled-path", type=Path, default=HERE.parent / "build" / "compiled")
    parser.add_argument(
        "--vllm-python", default=None, help=f"default: the first of {', '.join(VLLM_PYTHONS)}"
    )
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="profiling mode: 256 requests (96 at once), 3 reps (explicit flags still win)",
    )
    args = parser.parse_args()
    args.policies = args.policies.split(",")
    if args.quick:
        given = set(sys.argv[1:])
        for flag, attr, value in (
            ("--num-requests", "num_requests", 256),
            ("--max-running", "max_running", 96),
            ("--reps", "reps", 3),
        ):
            if flag not in given:
                setattr(args, attr, value)
    vllm_python = None if args.no_vllm else _vllm_python(args.vllm_python)
    console = Console(width=230)
    builds = _builds(args, console)
    for name in args.configs.split(","):
        _run_config(name, args, vllm_python, builds, console)
    if vllm_python is None and not args.no_vllm:
        console.print(
            "vLLM not found: hybridkv only (install: bash scripts/install_vllm033.sh "
            ".venv-vllm033, or pass --vllm-python)"
        )


if __name__ == "__main__":
    main()

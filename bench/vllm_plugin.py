"""vLLM with and without hybridkv's plugin, on vLLM's own CPU engine, side by side.

Question: what does a vLLM user get from ``pip install hybridkv`` beside vLLM? Same
model, same prompts, same KV budget (``VLLM_CPU_KVCACHE_SPACE``), two engine processes
that differ only in ``VLLM_PLUGINS`` (``none`` = stock, ``hybridkv``):

* capacity: attention block sizes, state padding, KV tokens and maximum concurrency at
  ``max_model_len``, as vLLM's own start-up log reports them;
* multi-turn chat (prefix caching on): prefix-hit tokens vLLM reports
  (``RequestOutput.num_cached_tokens``) against the token-exact bound (every token of the
  previous turn's context but its last), and whether both sides answer the same tokens;
* throughput: a batch of prompts, greedy, whole ``LLM.generate`` calls, ``--reps``
  alternating repetitions (stock, ours, stock, ...; prefix cache reset before each), median
  and range per side, and the ratio of each back-to-back pair; work counters (prompt,
  generated and cached tokens) of both sides printed.

The model is the tiny Qwen3-Next hybrid of `hybridkv.vllm.tiny_models` (random weights,
bf16, 6 Gated DeltaNet + 2 attention layers), written by vLLM's venv. vLLM runs in its own
venv (``scripts/install_vllm_cpu.sh``, ``--vllm-python``).

    python bench/vllm_plugin.py [--reps 5] [--batch 8] [--compile] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hybridkv.vllm.engine_process import EngineProcess

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _prompts(batch: int, num_tokens: int, vocab: int, seed: int = 1) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(num_tokens)] for _ in range(batch)]


def _capacity(proc: EngineProcess) -> dict[str, Any]:
    log = proc.kv_log()
    padding = log.state_padding_pct or 0.0  # vLLM logs nothing when pages are equal
    if log.hybridkv_line:  # vLLM's rule ran first and logged its padding; ours replaced it
        found = re.search(r"padding: state ([\d.]+)%", log.hybridkv_line)
        padding = float(found.group(1)) if found else float("nan")
    return {
        "block_sizes": list(log.block_sizes),
        "state_padding_pct": padding,
        "kv_tokens": log.kv_tokens,
        "max_concurrency": log.max_concurrency,
        "hybridkv_line": log.hybridkv_line,
    }


def _chat(proc: EngineProcess, args: argparse.Namespace) -> dict[str, Any]:
    answer = proc.call(
        {
            "op": "chat",
            "sessions": args.sessions,
            "turns": args.turns,
            "first_tokens": args.first_tokens,
            "user_tokens": args.user_tokens,
            "max_tokens": args.chat_max_tokens,
            "seed": 0,
        }
    )
    turns = answer["turns"]
    return {
        "hit_tokens": [t["hit_tokens"] for t in turns],
        "bound_tokens": [t["bound_tokens"] for t in turns],
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "outputs": [t["outputs"] for t in turns],
    }


def _throughput(
    procs: dict[str, EngineProcess], args: argparse.Namespace, prompts: list[list[int]]
) -> dict[str, Any]:
    command = {"op": "generate", "prompts": prompts, "max_tokens": args.max_tokens}
    # one untimed call each (first-call allocations); its tokens are the ones compared:
    # vLLM-CPU 0.32's n-gram path on Gated DeltaNet does not repeat its own tokens on a
    # second identical call (stock against itself: 3.5% agreement), so later calls are not
    first = {name: proc.call(command)["outputs"] for name, proc in procs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in procs}
    counters: dict[str, dict[str, int]] = {}
    for _ in range(args.reps):
        for name, proc in procs.items():
            answer = proc.call(command)
            seconds[name].append(answer["seconds"])
            counters[name] = {
                "prompt_tokens": sum(len(p) for p in prompts),
                "generated_tokens": sum(len(o) for o in answer["outputs"]),
                "cached_tokens": sum(answer["cached"]),
            }
    # throughput of ours over stock's, one back-to-back pair at a time
    pairs = [s / o for s, o in zip(seconds["stock"], seconds["hybridkv"], strict=True)]
    return {
        "seconds": seconds,
        "counters": counters,
        "pair_ratios": pairs,
        "same_outputs": first["stock"] == first["hybridkv"],
        "agreement": _agreement(first["stock"], first["hybridkv"]),
    }


def _agreement(theirs: list[list[int]], ours: list[list[int]]) -> float:
    """Share of generated tokens before each request's first disagreement (bf16 on random
    weights: a different block size changes the attention kernel's reduction order)."""
    same = total = 0
    for a, b in zip(theirs, ours, strict=True):
        total += len(a)
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return same / max(total, 1)


def _repetitive(batch: int, num_tokens: int, vocab: int) -> list[list[int]]:
    """Prompts made of a repeated 24-token motif, so that n-gram lookup proposes drafts."""
    motifs = _prompts(batch, 24, vocab, seed=2)
    return [(m * (num_tokens // len(m) + 1))[:num_tokens] for m in motifs]


def _section(
    args: argparse.Namespace, settings: dict[str, Any], chat: bool, repetitive: bool
) -> dict[str, Any]:
    procs: dict[str, EngineProcess] = {}
    try:
        for name, plugin in (("stock", False), ("hybridkv", True)):
            procs[name] = EngineProcess(args.vllm_python, settings, plugin=plugin)
        vocab = int(procs["stock"].ready["vocab"])
        make = _repetitive if repetitive else _prompts
        prompts = make(args.batch, args.prompt_tokens, vocab)
        section: dict[str, Any] = {
            "settings": settings,
            "capacity": {name: _capacity(p) for name, p in procs.items()},
            "throughput": _throughput(procs, args, prompts),
        }
        if chat:
            section["chat"] = {name: _chat(p, args) for name, p in procs.items()}
            runs = section["chat"]
            section["chat_same_outputs"] = runs["stock"]["outputs"] == runs["hybridkv"]["outputs"]
    finally:
        for proc in procs.values():
            proc.close()
    return section


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    work = Path(tempfile.mkdtemp(prefix="hybridkv-vllm-bench-"))
    model = work / "tiny_qwen3_next"
    subprocess.run(
        [str(args.vllm_python), "-m", "hybridkv.vllm.tiny_models", str(model)],
        check=True,
        capture_output=True,
    )
    base = {
        "model": str(model),
        "max_model_len": args.max_model_len,
        "max_num_seqs": 64,
        "enforce_eager": not args.compile,
        # vLLM-CPU keeps the DeltaNet state in float32 on AVX512-BF16 CPUs and in bf16
        # elsewhere (other pages, other blocks): pinned, the same plans on every CPU
        "mamba_ssm_cache_dtype": "float32",
    }
    sections = {"prefix caching": _section(args, base, chat=True, repetitive=False)}
    if not args.no_ngram:
        # vLLM's CPU worker cannot run n-gram drafts with prefix caching on a Gated
        # DeltaNet model (align mode's state pre-copy is a Triton kernel), so it is off here
        ngram = {
            **base,
            "enable_prefix_caching": False,
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            },
        }
        sections["n-gram K=3, no prefix caching"] = _section(
            args, ngram, chat=False, repetitive=True
        )
    return {"kv_gib": args.kv_gib, "sections": sections}


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    console = Console(width=150)
    table = Table(
        title=(
            f"vLLM-CPU 0.32, tiny Qwen3-Next (6 GDN + 2 attention, bf16), max_model_len "
            f"{args.max_model_len}, {args.kv_gib} GiB KV cache: stock vs hybridkv plugin"
        )
    )
    for column in ("section", "row", "stock vLLM", "vLLM + hybridkv", "ours / stock"):
        table.add_column(column, justify="left" if column in ("section", "row") else "right")
    lines = []
    for title, sec in result["sections"].items():
        cap, tput = sec["capacity"], sec["throughput"]

        def row(name: str, stock: Any, ours: Any, ratio: str = "", title: str = title) -> None:
            table.add_row(title, name, str(stock), str(ours), ratio)

        row(
            "attention block (tokens)",
            cap["stock"]["block_sizes"][-1],
            cap["hybridkv"]["block_sizes"][-1],
        )
        row(
            "state page padding",
            f"{cap['stock']['state_padding_pct']:.2f}%",
            f"{cap['hybridkv']['state_padding_pct']:.2f}%",
        )
        row(
            "KV cache tokens (vLLM's log)",
            f"{cap['stock']['kv_tokens']:,}",
            f"{cap['hybridkv']['kv_tokens']:,}",
            f"{cap['hybridkv']['kv_tokens'] / cap['stock']['kv_tokens']:.2f}x",
        )
        row(
            f"max concurrency @ {args.max_model_len}",
            cap["stock"]["max_concurrency"],
            cap["hybridkv"]["max_concurrency"],
            f"{cap['hybridkv']['max_concurrency'] / cap['stock']['max_concurrency']:.2f}x",
        )
        if "chat" in sec:
            chat = sec["chat"]
            bound = sum(chat["stock"]["bound_tokens"])
            hits = {n: sum(chat[n]["hit_tokens"]) for n in ("stock", "hybridkv")}
            row(
                f"chat {args.sessions}x{args.turns}: hit tokens (bound {bound})",
                f"{hits['stock']} ({100 * hits['stock'] / max(bound, 1):.1f}%)",
                f"{hits['hybridkv']} ({100 * hits['hybridkv'] / max(bound, 1):.1f}%)",
            )
            row("chat: hits per turn", chat["stock"]["hit_tokens"], chat["hybridkv"]["hit_tokens"])
            row("chat: same tokens", "", str(sec["chat_same_outputs"]))
        secs = tput["seconds"]
        row(
            f"batch {args.batch} x ({args.prompt_tokens} + {args.max_tokens}) s, {args.reps} reps",
            _median_range(secs["stock"]),
            _median_range(secs["hybridkv"]),
            f"throughput {_median_range(tput['pair_ratios'])}",
        )
        counters = tput["counters"]
        row(
            "  counters: prompt / generated / cached",
            "/".join(
                str(counters["stock"][k])
                for k in ("prompt_tokens", "generated_tokens", "cached_tokens")
            ),
            "/".join(
                str(counters["hybridkv"][k])
                for k in ("prompt_tokens", "generated_tokens", "cached_tokens")
            ),
        )
        row(
            "  same tokens (prefix agreement)",
            "",
            f"{tput['same_outputs']} ({100 * tput['agreement']:.1f}%)",
        )
        lines.append(f"{title}: {cap['hybridkv']['hybridkv_line']}")
    console.print(table)
    for line in lines:
        console.print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-tokens", type=int, default=300)
    parser.add_argument("--user-tokens", type=int, default=30)
    parser.add_argument("--chat-max-tokens", type=int, default=24)
    parser.add_argument("--compile", action="store_true", help="torch.compile (slow start)")
    parser.add_argument("--no-ngram", action="store_true", help="skip the n-gram section")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not Path(args.vllm_python).exists():
        raise SystemExit(
            f"no vLLM venv at {args.vllm_python}: run scripts/install_vllm_cpu.sh first"
        )
    result = run(args)
    if args.json:
        for section in result["sections"].values():
            for runs in section.get("chat", {}).values():
                runs.pop("outputs", None)
        print(json.dumps(result, indent=1))
    else:
        report(result, args)


if __name__ == "__main__":
    main()

"""vLLM's OpenAI server end to end over HTTP: stock vs the hybridkv plugin vs the plugin +
``--scheduler-cls hybridkv.vllm.Scheduler``, on vLLM's CPU engine.

Question: what does a user of ``vllm serve`` see, per request, with hybridkv installed?
Three servers (``python -m vllm.entrypoints.openai.api_server``, as the README starts
them), same model, same flags, same KV budget (``VLLM_CPU_KVCACHE_SPACE``); they differ
only in ``VLLM_PLUGINS`` (``none`` = stock) and the scheduler class.

Load: a multi-turn chat generator of this file (asyncio + httpx, streaming completions):
vLLM's ``bench serve`` on vllm-cpu 0.32 sends text only (its custom dataset tokenizes the
prompt) and replays turns without waiting for the previous answer, and the tiny model has
no tokenizer. ``--sessions`` conversations run concurrently; every one starts with the same
system prompt, and each turn's prompt is the previous turn's prompt + the answer the
server streamed + new user tokens (token ids; greedy, EOS ignored, so every side generates
the same number of tokens). Each repetition draws fresh tokens (seed = repetition), the
same on all three sides, so nothing cached in one repetition helps the next.

Per run: TTFT p50 / p90 (request sent -> first token received), output tokens/s over the
whole run (first request sent -> last stream closed), prefix-hit tokens from each
response's ``usage.prompt_tokens_details.cached_tokens`` against the token-exact bound
(the longest prefix the prompt shares with a request that had finished when it was sent,
that request's last generated token excluded: it was never fed back), vLLM's
``/metrics`` counters (prefix-cache hits / queries, preemptions, prompt and generation
tokens: both sides' work) and errors. ``--reps``
alternating repetitions (stock, plugin, ours, stock, ...), median [range], and per-pair
ratios against stock.

    .venv-vllm/bin/python bench/vllm_serve.py [--reps 5] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridkv.vllm.openai_server import (
    OpenAIServer,
    StreamResult,
    stream_completion,
    unexpected_tracebacks,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SIDES = {  # name: (plugin, hybridkv's scheduler)
    "stock": (False, False),
    "plugin": (True, False),
    "ours": (True, True),
}
COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def _chat(server: OpenAIServer, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One run of the multi-turn chat; per-request records and the run's wall time."""
    import httpx

    rng = random.Random(seed)
    vocab = 4096  # the tiny checkpoints' vocabulary

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    # drawn up front, so the prompts do not depend on which stream finishes first
    users = [
        [tokens(args.first_user_tokens if t == 0 else args.user_tokens) for t in range(args.turns)]
        for _ in range(args.sessions)
    ]
    finished: list[list[int]] = []  # contexts (prompt + answer) of finished requests
    records: list[dict[str, Any]] = []

    async def session(client: Any, s: int) -> None:
        context: list[int] = list(system)
        for turn in range(args.turns):
            prompt = context + users[s][turn]
            # a finished context's last token was generated but never fed back, so no cache
            # holds it; and the prompt's own last token is always computed
            bound = max((_common_prefix(prompt, done[:-1]) for done in finished), default=0)
            bound = min(bound, len(prompt) - 1)
            got: StreamResult = await stream_completion(
                client, server.url, server.model, prompt, args.max_tokens
            )
            records.append(
                {
                    "session": s,
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "output_tokens": len(got.output_ids),
                    "bound_tokens": bound,
                    "cached_tokens": got.cached_tokens or 0,
                    "ttft_s": got.ttft_s,
                    "seconds": got.seconds,
                    "error": got.error,
                }
            )
            if got.error is not None:
                return  # the conversation cannot go on without its answer
            context = prompt + got.output_ids
            finished.append(context)

    before = server.metrics()
    start = time.perf_counter()
    timeout = httpx.Timeout(args.request_timeout_s)
    async with httpx.AsyncClient(timeout=timeout) as client:
        tasks = [asyncio.create_task(session(client, s)) for s in range(args.sessions)]
        _, pending = await asyncio.wait(tasks, timeout=args.run_timeout_s)
        for task in pending:  # bounded run time: what did not finish counts as errors
            task.cancel()
    wall_s = time.perf_counter() - start
    after = server.metrics()
    expected = args.sessions * args.turns
    errors = sum(r["error"] is not None for r in records) + (expected - len(records))
    return {
        "wall_s": wall_s,
        "records": records,
        "errors": errors,
        "timed_out_sessions": len(pending),
        "counters": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS},
    }


def _summary(run: dict[str, Any]) -> dict[str, float]:
    ok = [r for r in run["records"] if r["error"] is None]
    ttfts = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    q = statistics.quantiles(ttfts, n=10, method="inclusive") if len(ttfts) > 1 else ttfts * 9
    bound = sum(r["bound_tokens"] for r in ok)
    counters = run["counters"]
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p90_ms": 1000 * q[8] if ttfts else float("nan"),
        "output_tok_s": sum(r["output_tokens"] for r in ok) / run["wall_s"],
        "wall_s": run["wall_s"],
        "hit_tokens": sum(r["cached_tokens"] for r in ok),
        "bound_tokens": bound,
        "hit_pct_of_bound": 100 * sum(r["cached_tokens"] for r in ok) / max(bound, 1),
        "metrics_hits": counters["vllm:prefix_cache_hits_total"],
        "metrics_queries": counters["vllm:prefix_cache_queries_total"],
        "preemptions": counters["vllm:num_preemptions_total"],
        "prompt_tokens": counters["vllm:prompt_tokens_total"],
        "generation_tokens": counters["vllm:generation_tokens_total"],
        "client_output_tokens": sum(r["output_tokens"] for r in run["records"]),
        "requests_ok": len(ok),
        "errors": run["errors"],
    }


def _server_args(args: argparse.Namespace) -> list[str]:
    flags = [
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        "64",
        "--dtype",
        "bfloat16",
        # vLLM-CPU keeps the DeltaNet state in float32 on AVX512-BF16 CPUs and in bf16
        # elsewhere: pinned, the same plan on every CPU (as bench/vllm_plugin.py)
        "--mamba-ssm-cache-dtype",
        "float32",
        "--seed",
        "0",
    ]
    return flags if args.compile else [*flags, "--enforce-eager"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    from hybridkv.vllm.tiny_models import write_tiny_qwen3_next

    model = write_tiny_qwen3_next(Path(tempfile.mkdtemp(prefix="hybridkv-vllm-serve-")))
    servers: dict[str, OpenAIServer] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
    started: dict[str, float] = {}
    try:
        for name, (plugin, scheduler) in SIDES.items():  # one at a time: 2 cores
            t0 = time.perf_counter()
            servers[name] = OpenAIServer(
                args.vllm_python, model, plugin=plugin, scheduler=scheduler, args=_server_args(args)
            )
            started[name] = time.perf_counter() - t0
            print(f"{name}: server up in {started[name]:.0f} s", file=sys.stderr)
        # one untimed request each: first-request allocations and kernel warm-up
        for server in servers.values():
            server.complete(list(range(1, args.system_tokens + 1)), args.max_tokens)
        for rep in range(args.reps):
            for name, server in servers.items():
                run_ = asyncio.run(_chat(server, args, seed=rep))
                runs[name].append(run_)
                s = _summary(run_)
                print(
                    f"rep {rep} {name}: {s['wall_s']:.1f} s, {s['output_tok_s']:.1f} tok/s, "
                    f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, hits {s['hit_tokens']}/"
                    f"{s['bound_tokens']}, errors {s['errors']}",
                    file=sys.stderr,
                )
        logs = {name: server.log_text for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.close()
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "vllm_python"},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d"),
        "start_s": started,
        "summaries": {name: [_summary(r) for r in rs] for name, rs in runs.items()},
        "tracebacks": {name: len(unexpected_tracebacks(log)) for name, log in logs.items()},
        "plan_lines": {
            name: [line for line in log.splitlines() if "hybridkv plan (" in line][-1:]
            for name, log in logs.items()
        },
    }


def _median_range(values: list[float], fmt: str) -> str:
    return (
        f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"
        if values
        else "-"
    )


def report(result: dict[str, Any]) -> None:
    sums = result["summaries"]
    settings = result["settings"]
    print(
        f"\nvLLM-CPU 0.32 OpenAI server, tiny Qwen3-Next (6 GDN + 2 attention, bf16, fp32 "
        f"state), {settings['kv_gib']} GiB KV, chat {settings['sessions']} sessions x "
        f"{settings['turns']} turns (system {settings['system_tokens']} + first "
        f"{settings['first_user_tokens']}, then +{settings['user_tokens']} per turn, "
        f"{settings['max_tokens']} out), {settings['reps']} alternating reps; "
        f"{result['date']}, {result['machine']}\n"
    )
    print(
        "| median [range] | stock vLLM | + plugin | + plugin + scheduler | plugin / stock "
        "| ours / stock |"
    )
    print("|---|---|---|---|---|---|")
    rows = (
        ("TTFT p50 (ms)", "ttft_p50_ms", ".0f", "lower"),
        ("TTFT p90 (ms)", "ttft_p90_ms", ".0f", "lower"),
        ("output tokens/s", "output_tok_s", ".1f", "higher"),
        ("run wall time (s)", "wall_s", ".1f", "lower"),
        ("prefix-hit tokens (responses)", "hit_tokens", ".0f", None),
        ("  % of the token-exact bound", "hit_pct_of_bound", ".1f", None),
        ("/metrics prefix-cache hits", "metrics_hits", ".0f", None),
        ("/metrics prefix-cache queries", "metrics_queries", ".0f", None),
        ("/metrics preemptions", "preemptions", ".0f", None),
        ("/metrics prompt / generation tokens", None, "", None),
        ("requests ok / errors", None, "", None),
    )
    for title, key, fmt, better in rows:
        if key is None and title.startswith("/metrics prompt"):
            cells = [
                "/".join(
                    _median_range([s[k] for s in sums[n]], ".0f")
                    for k in ("prompt_tokens", "generation_tokens")
                )
                for n in SIDES
            ]
            print(f"| {title} | " + " | ".join(cells) + " | | |")
            continue
        if key is None:
            cells = [
                f"{sum(s['requests_ok'] for s in sums[n])} / {sum(s['errors'] for s in sums[n])}"
                for n in SIDES
            ]
            print(f"| {title} (all reps) | " + " | ".join(cells) + " | | |")
            continue
        cells = [_median_range([s[key] for s in sums[n]], fmt) for n in SIDES]
        ratios = []
        for side in ("plugin", "ours"):
            if better is None:
                ratios.append("")
                continue
            # one back-to-back pair per repetition; > 1 means better than stock
            pair = [
                (o[key] / s[key]) if better == "higher" else (s[key] / o[key])
                for s, o in zip(sums["stock"], sums[side], strict=True)
            ]
            ratios.append(_median_range(pair, ".3f"))
        print(f"| {title} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print("\nratios: > 1 is better than stock (TTFT and wall time: stock / side)")
    print(
        "tracebacks in the server logs (less the tokenizer-less chat-template warm-up):",
        result["tracebacks"],
    )
    print("server start (s):", {k: round(v) for k, v in result["start_s"].items()})
    for name, lines in result["plan_lines"].items():
        for line in lines:
            print(f"{name}: {line.split('] ', 1)[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--first-user-tokens", type=int, default=100)
    parser.add_argument("--user-tokens", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    parser.add_argument("--compile", action="store_true", help="torch.compile (slow start)")
    parser.add_argument("--quick", action="store_true", help="2 reps, 4 sessions x 2 turns")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.sessions, args.turns = 2, 4, 2
    if not Path(args.vllm_python).exists():
        raise SystemExit(
            f"no vLLM venv at {args.vllm_python}: run scripts/install_vllm_cpu.sh first"
        )
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        report(result)


if __name__ == "__main__":
    main()

"""Serving overhead: N concurrent streaming HTTP clients of `hybridkv serve` against
`LLM.generate` offline, on the same prompts with the same engine configuration.

Question: what does the HTTP layer (FastAPI + uvicorn + the engine-loop thread, one SSE
chunk per step) cost in throughput and first-token latency, and is the text the same?
Each repetition builds fresh engines (no prefix cache carried over) and alternates the
order of the two sides. Prints per side: median and range of wall time and output
tokens/s, median time to first token (server: first streamed chunk; offline: not
observable, shown as -), work counters (engine steps, tokens, prefix hit tokens, drafts
proposed / accepted), and the ratio server / offline. Greedy; ``ignore_eos`` so every
request generates ``--max-tokens``.

    python bench/serve_http.py [--clients 8] [--max-tokens 64] [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx
import torch

from hybridkv.cli.engine import load_llm
from hybridkv.demo import demo_prompts
from hybridkv.serve.metrics import parse
from hybridkv.serve.server import BackgroundServer

DEMO = {"draft": "demo-draft", "num_spec": 4}


def offline(prompts: list[str], max_tokens: int) -> dict:
    llm = load_llm("demo", **DEMO)
    start = time.perf_counter()
    results = llm.generate(prompts, max_tokens, temperature=0.0, ignore_eos=True)
    wall = time.perf_counter() - start
    stats = llm.stats()
    return {
        "wall_s": wall,
        "ttft_s": None,
        "texts": [r.text for r in results],
        "steps": stats.num_steps,
        "tokens": stats.num_output_tokens,
        "hits": sum(r.stats.prefix_hit_tokens for r in results),
        "drafts": stats.num_proposed_tokens,
        "accepted": stats.num_accepted_tokens,
    }


def served(prompts: list[str], max_tokens: int) -> dict:
    with BackgroundServer(load_llm("demo", **DEMO), "demo") as srv:
        texts: list[str] = [""] * len(prompts)
        first: list[float] = [0.0] * len(prompts)
        gate = threading.Barrier(len(prompts) + 1)

        def client(i: int) -> None:
            body = {
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.Client(base_url=srv.url, timeout=300) as c:
                gate.wait()
                with c.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        if not first[i]:
                            first[i] = time.perf_counter()
                        texts[i] += json.loads(line[6:])["choices"][0]["text"]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        gate.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        m = {k.split("{")[0]: v for k, v in parse(httpx.get(srv.url + "/metrics").text).items()}
    return {
        "wall_s": wall,
        "ttft_s": statistics.median(f - start for f in first),
        "texts": texts,
        "steps": int(m["hybridkv:engine_steps_total"]),
        "tokens": int(m["hybridkv:generation_tokens_total"]),
        "hits": int(m["hybridkv:prefix_cache_hits_total"]),
        "drafts": int(m["hybridkv:spec_decode_num_draft_tokens_total"]),
        "accepted": int(m["hybridkv:spec_decode_num_accepted_tokens_total"]),
    }


def summary(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    rates = [r["tokens"] / r["wall_s"] for r in runs]
    ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
    return {
        "wall_s": (statistics.median(walls), min(walls), max(walls)),
        "tok_s": (statistics.median(rates), min(rates), max(rates)),
        "ttft_s": statistics.median(ttfts) if ttfts else None,
        "steps": statistics.median(r["steps"] for r in runs),
        "tokens": runs[0]["tokens"],
        "hits": runs[0]["hits"],
        "drafts": statistics.median(r["drafts"] for r in runs),
        "accepted": statistics.median(r["accepted"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = demo_prompts(args.clients)
    sides: dict[str, list[dict]] = {"offline": [], "server": []}
    for rep in range(args.reps):
        order = ["offline", "server"] if rep % 2 == 0 else ["server", "offline"]
        for side in order:
            run = offline if side == "offline" else served
            sides[side].append(run(prompts, args.max_tokens))
    same = all(
        s["texts"] == o["texts"] for s, o in zip(sides["server"], sides["offline"], strict=True)
    )
    print(
        f"demo pair (draft K=4), {args.clients} clients x {args.max_tokens} tokens, greedy, "
        f"torch threads {args.threads}, {args.reps} alternating reps"
    )
    print(
        f"{'side':8} {'wall s (med, range)':>24} {'tok/s (med, range)':>24} {'ttft s':>7} "
        f"{'steps':>6} {'tokens':>6} {'hits':>5} {'drafts':>6} {'accept':>6}"
    )
    rows = {side: summary(runs) for side, runs in sides.items()}
    for side, r in rows.items():
        wall, rate = r["wall_s"], r["tok_s"]
        ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s']:.3f}"
        print(
            f"{side:8} {wall[0]:8.3f} ({wall[1]:.3f}-{wall[2]:.3f}) "
            f"{rate[0]:8.1f} ({rate[1]:.1f}-{rate[2]:.1f}) {ttft:>7} {r['steps']:>6} "
            f"{r['tokens']:>6} {r['hits']:>5} {r['drafts']:>6} {r['accepted']:>6}"
        )
    ratio = rows["server"]["tok_s"][0] / rows["offline"]["tok_s"][0]
    print(f"server / offline tokens/s (medians): {ratio:.2f}x; same text every rep: {same}")


if __name__ == "__main__":
    main()

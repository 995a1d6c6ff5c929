"""Replay a `manager_step` trace through vLLM's own `KVCacheManager` (run in vLLM's venv).

Usage: ``VLLM_TARGET_DEVICE=cpu python bench/_vllm_driver.py SPEC.json`` prints one JSON
line: the timers and counters of `_trace_loop.run`. SPEC.json (written by
``bench/manager_step.py``) holds the groups, pool size and trace. Standalone: imports
vLLM and `_trace_loop`, not hybridkv.

The calls mirror vLLM's scheduler: every step starts with ``new_step_starts()``; a new
request is built (its block hasher hashes the
prompt) and admitted with ``get_computed_blocks`` + ``allocate_slots(req, n, hit,
blocks)``; a prefill chunk is ``allocate_slots(req, n)``; a decode step with d drafts is
``allocate_slots(req, 1 + d)`` with the drafts in ``spec_token_ids``; after the step
``num_computed_tokens += n + a`` and the emitted tokens are appended (which hashes
new full blocks); a finished request is ``free``d. Prefill chunks follow vLLM's align
split (`_trace_loop.chunk_end`), so vLLM caches the state at every chunk end.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trace_loop import run


def group_spec(group: dict) -> object:
    kind, block = group["kind"], group["block_size"]
    if kind == "full_attention":
        return FullAttentionSpec(
            block_size=block,
            num_kv_heads=group["num_kv_heads"],
            head_size=group["head_dim"],
            dtype=torch.bfloat16,
        )
    if kind == "sliding_attention":
        return SlidingWindowSpec(
            block_size=block,
            num_kv_heads=group["num_kv_heads"],
            head_size=group["head_dim"],
            dtype=torch.bfloat16,
            sliding_window=group["sliding_window"],
        )
    if kind == "state":
        return MambaSpec(
            block_size=block,
            shapes=((4, 64), (8, 64, 64)),
            dtypes=(torch.bfloat16, torch.float32),
            mamba_cache_mode="align",
            num_speculative_blocks=group["num_spec"],
        )
    raise SystemExit(f"unsupported group kind {kind!r}")


class VllmAdapter:
    def __init__(self, spec: dict) -> None:
        groups = [
            KVCacheGroupSpec([f"layer{i}"], group_spec(g)) for i, g in enumerate(spec["groups"])
        ]
        config = KVCacheConfig(
            num_blocks=spec["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups
        )
        block_sizes = [g["block_size"] for g in spec["groups"]]
        self.hash_block = min(block_sizes)
        self.manager = KVCacheManager(
            config,
            max_model_len=spec["max_model_len"],
            scheduler_block_size=max(block_sizes),
            hash_block_size=self.hash_block,
            enable_caching=True,
        )
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(self.hash_block, hash_fn)
        self.params = SamplingParams(max_tokens=1 << 20)
        self.requests: dict[int, Request] = {}
        self.num_allocations = 0
        self.peak_used = 0
        self.pool = self.manager.block_pool
        self.sub_timers = {"add": 0.0, "lookup": 0.0, "first_allocate": 0.0}

    def _track(self) -> None:
        used = self.pool.num_gpu_blocks - self.pool.get_num_free_blocks()
        if used > self.peak_used:
            self.peak_used = used

    def begin_step(self) -> None:
        self.manager.new_step_starts()  # as vLLM's scheduler does at every step

    def admit(self, index: int, prompt: list[int], chunk: Callable[[int], int]) -> int | None:
        clock, sub = time.process_time, self.sub_timers
        t0 = clock()
        req = Request(f"r{index}", prompt, self.params, None, block_hasher=self.hasher)
        t1 = clock()
        blocks, hit = self.manager.get_computed_blocks(req)[:2]
        self.num_allocations += 1
        n = chunk(hit)
        t2 = clock()
        out = self.manager.allocate_slots(req, n, hit, blocks)
        t3 = clock()
        sub["add"] += t1 - t0  # the request's block hasher hashes the prompt here
        sub["lookup"] += t2 - t1
        sub["first_allocate"] += t3 - t2
        if out is None:
            return None
        req.num_computed_tokens = hit
        self.requests[index] = req
        return hit

    def allocate(self, items: list[tuple[int, int, int]]) -> bool:
        requests, allocate = self.requests, self.manager.allocate_slots
        self.num_allocations += len(items)
        for index, n, drafts in items:
            req = requests[index]
            if drafts:
                req.spec_token_ids = [7] * drafts
            if allocate(req, n + drafts) is None:
                return False
        return True

    def commit(self, items: list[tuple[int, int, int, list[int]]]) -> None:
        requests = self.requests
        for index, n, accepted, new in items:
            req = requests[index]
            if req.spec_token_ids:
                req.spec_token_ids = []
            req.num_computed_tokens += n + accepted
            if new:
                req.append_output_token_ids(new)

    def free(self, indexes: list[int]) -> None:
        requests, free = self.requests, self.manager.free
        for index in indexes:
            free(requests.pop(index))


def main(path: str) -> None:
    with open(path) as handle:
        spec = json.load(handle)
    adapter = VllmAdapter(spec)
    if spec.get("measure_peak"):  # sizing run: track blocks in use after every call
        for name in ("admit", "allocate", "commit"):
            method = getattr(adapter, name)

            def tracked(*args, _method=method):  # type: ignore[no-untyped-def]
                out = _method(*args)
                adapter._track()
                return out

            setattr(adapter, name, tracked)
    evictions = [0]
    if spec.get("measure_peak"):
        evict = adapter.pool._maybe_evict_cached_block

        def counted(block):  # type: ignore[no-untyped-def]
            hit = evict(block)
            evictions[0] += bool(hit)
            return hit

        adapter.pool._maybe_evict_cached_block = counted
    result = run(spec["trace"], adapter)
    result["evictions"] = evictions[0] if spec.get("measure_peak") else None
    result["counts"]["allocate_calls"] = adapter.num_allocations
    result["peak_used_blocks"] = adapter.peak_used
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])

"""Drive vLLM's own `KVCacheManager` with a `manager_step` trace (run in vLLM's venv).

Usage: ``VLLM_TARGET_DEVICE=cpu python bench/_vllm_driver.py SPEC.json`` prints one JSON
line: ``{"us_per_step": ..., "hit_tokens": ..., "num_steps": ...}``. SPEC.json (written
by ``bench/manager_step.py``) holds the groups, pool size, prompts, outputs and the
per-step ``[drafts, accepted]`` of every request. Standalone: imports vLLM, not hybridkv.

The step mirrors vLLM's scheduler for a decode with d drafts: ``allocate_slots(req,
1 + d)`` with the drafts in ``spec_token_ids``; after verification
``num_computed_tokens += 1 + d - (d - a)`` and ``a + 1`` tokens are appended (which
hashes new full blocks). Timed: allocate_slots and the token append, per step.
"""

from __future__ import annotations

import json
import sys
import time

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


def main(path: str) -> None:
    with open(path) as handle:
        spec = json.load(handle)
    groups = [KVCacheGroupSpec([f"layer{i}"], group_spec(g)) for i, g in enumerate(spec["groups"])]
    config = KVCacheConfig(
        num_blocks=spec["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups
    )
    block_sizes = [g["block_size"] for g in spec["groups"]]
    hash_block = min(block_sizes)
    manager = KVCacheManager(
        config,
        max_model_len=spec["max_model_len"],
        scheduler_block_size=max(block_sizes),
        hash_block_size=hash_block,
        enable_caching=True,
    )
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_block, hash_fn)
    params = SamplingParams(max_tokens=1 << 20)
    requests, cursor, hit_tokens = [], [], 0
    for i, prompt in enumerate(spec["prompts"]):
        req = Request(f"r{i}", list(prompt), params, None, block_hasher=hasher)
        blocks, hit, *_ = manager.get_computed_blocks(req)
        new = manager.allocate_slots(req, len(prompt) - hit, hit, blocks)
        if new is None:
            raise SystemExit(f"admission of request {i} failed: pool too small")
        hit_tokens += hit
        req.num_computed_tokens = len(prompt)
        req.append_output_token_ids(spec["outputs"][i][0])
        requests.append(req)
        cursor.append(1)
    total_s = 0.0
    for step in spec["steps"]:
        start = time.perf_counter()
        for req, (drafts, _) in zip(requests, step, strict=False):
            req.spec_token_ids = [7] * drafts
            if manager.allocate_slots(req, 1 + drafts) is None:
                raise SystemExit("decode allocation failed: pool too small")
        for i, (req, (_, accepted)) in enumerate(zip(requests, step, strict=False)):
            req.spec_token_ids = []
            req.num_computed_tokens += 1 + accepted
            out = spec["outputs"][i]
            req.append_output_token_ids(out[cursor[i] : cursor[i] + accepted + 1])
            cursor[i] += accepted + 1
        total_s += time.perf_counter() - start
    for req in requests:
        manager.free(req)
    print(
        json.dumps(
            {
                "us_per_step": total_s * 1e6 / len(spec["steps"]),
                "hit_tokens": hit_tokens,
                "num_steps": len(spec["steps"]),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])

"""vLLM's own `KVCacheManager` under the prefix-policy study's scheduler and traces (run in
vLLM's venv with hybridkv's ``src`` on the path; `prefix_policies.py --vllm-python`).

Usage: ``VLLM_TARGET_DEVICE=cpu python bench/_vllm_study.py JOBS.json`` prints one JSON
line per job: ``{"key": ..., "hit": ..., "evictions": ...}`` or ``{"key": ...,
"error": ...}``. A job names a study row (family, model, spec, GiB, seed); the trace
and the ``vllm`` layout plan are rebuilt here from the same seeded code, so both sides
see the same requests.

`VllmFacade` puts vLLM's manager behind the calls hybridkv's scheduler makes of a
`CacheManager` (add, lookup, allocate, commit, free, preempt, usage, block hashes), the
way vLLM's own scheduler drives it: a lookup is ``get_computed_blocks``; the admission
is ``allocate_slots(req, n, hit, blocks)``; a decode step with L drafts sets
``spec_token_ids`` and allocates ``n + L``; a commit advances ``num_computed_tokens`` and
appends the emitted tokens (which hashes new full blocks); preemption frees and resets
the computed count. vLLM keeps its own policies: LRU eviction, ``align`` state
checkpoints at block boundaries, no junction or turn-end rule. The pool has the
plan's number of blocks (the same memory as the study's ``vllm rule`` column).
Only spec ``none`` and ``ngram`` are replayed (no drafter KV to place).
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _vllm_driver import group_spec  # noqa: E402
from hybridkv.models import load_model_spec  # noqa: E402
from hybridkv.plan import PlanOptions, plan  # noqa: E402
from hybridkv.sim import simulate  # noqa: E402
from hybridkv.spec import AttentionSpec, DType, SlidingWindowSpec  # noqa: E402
from prefix_policies import GiB, pressure_models, study_trace  # noqa: E402


@dataclass(frozen=True)
class Stats:
    """What `simulate` reads from a manager's ``stats()`` (a dataclass)."""

    num_evictions: int


class VllmFacade:
    caching = True

    def __init__(self, cache_plan: Any, k: int) -> None:
        groups = []
        for g in cache_plan.groups:
            entry: dict[str, Any] = {"kind": g.kind, "block_size": g.block_size, "num_spec": k}
            if isinstance(g.spec, AttentionSpec):
                entry.update(num_kv_heads=g.spec.num_kv_heads, head_dim=g.spec.head_dim)
            if isinstance(g.spec, SlidingWindowSpec):
                entry["sliding_window"] = g.spec.sliding_window
            groups.append(entry)
        specs = [KVCacheGroupSpec([f"layer{i}"], group_spec(g)) for i, g in enumerate(groups)]
        num_blocks = sum(p.num_pages for p in cache_plan.pools)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
        sizes = [g["block_size"] for g in groups]
        self.hash_unit_tokens = min(sizes)
        self.manager = KVCacheManager(
            config,
            max_model_len=cache_plan.options.max_model_len,
            scheduler_block_size=max(sizes),
            hash_block_size=self.hash_unit_tokens,
            enable_caching=True,
        )
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(self.hash_unit_tokens, hash_fn)
        self.params = SamplingParams(max_tokens=1 << 20)
        self.requests: dict[str, Request] = {}
        self.found: dict[str, tuple[Any, int]] = {}
        self.started: set[str] = set()
        self.pending: dict[str, int] = {}  # req -> n of the allocated step
        self.num_evictions = 0
        pool = self.manager.block_pool
        evict = pool._maybe_evict_cached_block

        def counted(block: Any) -> bool:
            hit = evict(block)
            self.num_evictions += bool(hit)
            return hit

        pool._maybe_evict_cached_block = counted
        self.pool = pool

    def add_request(self, req_id: str, prompt: list[int], cache_salt: str | None = None) -> None:
        self.requests[req_id] = Request(
            req_id, list(prompt), self.params, None, cache_salt=cache_salt, block_hasher=self.hasher
        )

    def lookup(self, req_id: str) -> int:
        blocks, hit = self.manager.get_computed_blocks(self.requests[req_id])[:2]
        self.found[req_id] = (blocks, hit)
        return hit

    def allocate(self, req_id: str, n: int, lookahead: int = 0) -> Any:
        req = self.requests[req_id]
        if lookahead:
            req.spec_token_ids = [7] * lookahead
        if req_id not in self.started:
            blocks, hit = self.found.pop(req_id)
            out = self.manager.allocate_slots(req, n, hit, blocks)
            if out is None:
                return None
            req.num_computed_tokens = hit
            self.started.add(req_id)
        elif self.manager.allocate_slots(req, n + lookahead) is None:
            req.spec_token_ids = []
            return None
        self.pending[req_id] = n
        return True

    def commit(self, req_id: str, accepted: int = 0, new: list[int] | tuple = ()) -> None:
        req = self.requests[req_id]
        req.spec_token_ids = []
        req.num_computed_tokens += self.pending.pop(req_id) + accepted
        if new:
            req.append_output_token_ids(list(new))

    def free(self, req_id: str) -> None:
        self.manager.free(self.requests.pop(req_id))
        self.started.discard(req_id)
        self.found.pop(req_id, None)

    def preempt(self, req_id: str) -> None:
        req = self.requests[req_id]
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self.started.discard(req_id)
        self.pending.pop(req_id, None)

    def usage(self) -> float:
        # The simulator reads the usage once after every step: the step boundary at
        # which vLLM's scheduler calls ``new_step_starts()`` (its per-step accounting
        # of in-flight tokens is wrong without it).
        self.manager.new_step_starts()
        return float(self.manager.usage)

    def block_hashes(self, req_id: str, start: int = 0, stop: int | None = None) -> list[Any]:
        return list(self.requests[req_id].block_hashes[start:stop])

    def has_request(self, req_id: str) -> bool:
        return req_id in self.requests

    def num_computed_tokens(self, req_id: str) -> int:
        return self.requests[req_id].num_computed_tokens

    def num_free_blocks(self, pool_id: int = 0) -> int:
        return self.pool.get_num_free_blocks()

    def stats(self) -> Stats:
        return Stats(num_evictions=self.num_evictions)

    def check_invariants(self) -> None:
        """vLLM checks its own; nothing to add."""


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    pressure = pressure_models()
    name = job["model"]
    main = pressure[name] if name in pressure else load_model_spec(name)
    method = None if job["spec"] == "none" else job["spec"]
    extra: dict[str, Any] = {}
    if job["family"] == "roundrobin":
        extra = {"kv_dtype": DType.FP8_E4M3, "block_size": 16}
    options = PlanOptions(
        spec_method=method,
        num_spec_tokens=3 if method else 0,
        memory_bytes=int(job["memory_gib"] * GiB),
        max_model_len=32768,
        layout="vllm",
        state_mode="align",
        **extra,
    )
    cache_plan = plan(main, None, options)
    trace = study_trace(job["family"], method, job["seed"], job["full"])
    facade = VllmFacade(cache_plan, options.num_spec_tokens)
    result = simulate(trace, cache_plan, manager=facade)
    return {"key": job["key"], "hit": result.prefix_hit_rate, "evictions": facade.num_evictions}


def main(path: str) -> None:
    with open(path) as handle:
        jobs = json.load(handle)
    for job in jobs:
        try:
            out = run_job(job)
        except Exception as err:  # one failed row must not lose the others
            out = {"key": job["key"], "error": f"{type(err).__name__}: {err}"}
            traceback.print_exc(file=sys.stderr)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

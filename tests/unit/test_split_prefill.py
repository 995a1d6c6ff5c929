"""Split layout: a window pool must leave room for a step's prefill chunks (issue 10).

gpt-oss-120b (sliding window 128 on half its layers) under the split layout used to size
the sliding pool for decoding requests only: it reported N requests, and none of them
could prefill an 8,192-token chunk. The pool now holds N requests at the target length
plus one step of ``max_num_batched_tokens`` in flight; checked here by real allocation.
"""

from __future__ import annotations

import pytest

from hybridkv.cache import CacheManager
from hybridkv.models import load_model_spec
from hybridkv.plan import PlanOptions, plan
from hybridkv.spec import SlidingWindowSpec

TARGET = 16384
CHUNK = 8192


def _split_plan(max_num_seqs: int) -> object:
    return plan(
        load_model_spec("gpt-oss-120b"),
        None,
        PlanOptions(
            layout="split",
            memory_bytes=3 << 30,
            max_model_len=TARGET,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=CHUNK,
            prefix_caching=False,
        ),
    )


@pytest.mark.parametrize("max_num_seqs", [1, 4, 256])
def test_sliding_pool_holds_decoders_plus_one_prefill_chunk(max_num_seqs: int) -> None:
    cache_plan = _split_plan(max_num_seqs)
    n = min(cache_plan.capacity.max_concurrency, max_num_seqs)
    assert n >= 1
    sliding = next(g for g in cache_plan.groups if isinstance(g.spec, SlidingWindowSpec))
    pool = cache_plan.pools[sliding.pool_id]
    decode = sliding.blocks_for(TARGET)
    prefill = sliding.blocks_for(CHUNK, 0, num_new_tokens=CHUNK)
    assert prefill > decode  # the chunk is what the old sizing forgot
    assert pool.num_usable_blocks >= (n - 1) * decode + prefill


def test_manager_prefills_a_full_chunk_while_others_decode() -> None:
    cache_plan = _split_plan(256)
    n = cache_plan.capacity.max_concurrency
    manager = CacheManager(cache_plan)
    # n - 1 requests reach the target length chunk by chunk (sliding blocks behind the
    # window are released after each step), then sit decoding
    for i in range(n - 1):
        req = f"r{i}"
        manager.add_request(req, list(range(TARGET - 1)))
        manager.lookup(req)
        done = 0
        while done < TARGET - 1:
            step = min(CHUNK, TARGET - 1 - done)
            assert manager.allocate(req, step) is not None, (req, done)
            manager.commit(req)
            done += step
    # the last admitted request prefills a whole chunk in one step
    manager.add_request("last", list(range(CHUNK)))
    manager.lookup("last")
    assert manager.allocate("last", CHUNK) is not None
    manager.check_invariants()

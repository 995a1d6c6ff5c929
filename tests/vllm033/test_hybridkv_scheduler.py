"""`hybridkv.vllm.Scheduler` driven step by step through vLLM 0.33's public scheduler API.

No kernels and no weights: the tests build vLLM's configs (a tiny config.json written with
transformers), a `KVCacheConfig` of vLLM's spec classes, vLLM's `Request`s, and answer
each `schedule()` with a `ModelRunnerOutput` the way vLLM's worker does (a token for every
request whose scheduled tokens reach its end; drafts accepted as the test says). A fake
worker keeps each request's block rows exactly as vLLM's worker does (a new request's row
arrives whole, later steps append, a resumed request's row is replaced) and every step is
checked against the manager (`scheduler.check_invariants()`, rows equal, attention rows
long enough for the scheduled tokens). At the end every request has finished and every
block is back in the pool.

vLLM's issue #39271 (`test_hybrid_model_mamba_align_with_dynamic_draft_tokens` in vLLM
0.33's tests/v1/core/test_prefix_caching.py): with suffix decoding the number of drafts
changes every step, and vLLM's Mamba manager asserted when a step asked for fewer blocks
than the last (a 55-token prompt with blocks of 16, 16 drafts with one accepted, then one
draft). The scenario runs on all three configurations through hybridkv's manager; on
the hybrid one the state group follows the worker's per-draft columns, with 15 drafts at
most: with prefix caching hybridkv takes fewer speculative tokens than a state block
holds (vLLM's post-copy checkpoints one boundary per step), and leaves 16 drafts on
16-token blocks to vLLM's own manager with the reason (checked).

Runs only in vLLM 0.33's venv (``scripts/install_vllm033.sh``)::

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -m vllm tests/vllm033
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
WINDOW_TOKENS = 32
EOS_TOKEN_ID = 2  # the tiny config's eos; outputs never produce it (ignore_eos anyway)


# ---------------------------------------------------------------------- building
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny decoder config.json: vLLM's `ModelConfig` reads it (no weights, no hub)."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny_opt")
    transformers.OPTConfig(
        vocab_size=1000,
        hidden_size=64,
        word_embed_proj_dim=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        eos_token_id=EOS_TOKEN_ID,
        architectures=["OPTForCausalLM"],
    ).save_pretrained(folder)
    return folder


def group_specs(layout: str) -> list[Any]:
    """vLLM's KV-cache group specs: ``full``, ``sliding`` (sliding window + full) or
    ``hybrid`` (full attention + a Mamba / Gated DeltaNet state group in align mode)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    if layout == "full":
        return [full]
    if layout == "sliding":
        window = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=WINDOW_TOKENS,
        )
        return [full, window]
    if layout == "hybrid":
        state = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((1, 1),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        )
        return [full, state]
    raise ValueError(f"unknown layout {layout!r}")


def build_scheduler(
    model_dir: Path,
    layout: str,
    *,
    num_blocks: int = 200,
    prefix_caching: bool = True,
    num_spec_tokens: int = 0,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
    async_scheduling: bool = False,
) -> Any:
    """`hybridkv.vllm.Scheduler` over vLLM's configs for ``layout`` (`group_specs`);
    ``async_scheduling`` is set as vLLM's engine arguments leave it (after the config's
    own checks, which refuse n-gram drafts with async scheduling)."""
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridkv.vllm import Scheduler

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    spec = None
    if num_spec_tokens:
        spec = SpeculativeConfig(model="ngram", num_speculative_tokens=num_spec_tokens)
    config = VllmConfig(
        model_config=model, scheduler_config=sched, cache_config=cache, speculative_config=spec
    )
    config.scheduler_config.async_scheduling = async_scheduling
    specs = group_specs(layout)
    if layout == "hybrid":
        config.cache_config.mamba_cache_mode = "align"
    kv_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )
    config.cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(config)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        block_size=BLOCK_SIZE,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
    )


def make_request(req_id: str, prompt: Sequence[int], max_tokens: int) -> Any:
    """vLLM's `Request` with the block hasher vLLM's engine gives it (vLLM's own manager,
    when hybridkv's scheduler falls back to it, keys the prefix cache with it)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


# ---------------------------------------------------------------------- the fake worker
@dataclass
class Worker:
    """What vLLM's worker holds per request: one block row per group (append-only; a
    resumed request's row is replaced), dropped when finished or preempted."""

    rows: dict[str, list[list[int]]] = field(default_factory=dict)
    num_preempted: int = 0

    def apply(self, out: Any) -> None:
        for req_id in out.finished_req_ids:
            self.rows.pop(req_id, None)
        for req_id in out.preempted_req_ids or ():
            self.num_preempted += 1
            self.rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.rows[new.req_id] = [list(row) for row in new.block_ids]
        cached = out.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids:
                assert new_ids is not None, f"{req_id} resumed without its block rows"
                self.rows[req_id] = [list(row) for row in new_ids]
            elif new_ids is not None:
                for row, ids in zip(self.rows[req_id], new_ids, strict=True):
                    row.extend(ids)


def check_step(scheduler: Any, worker: Worker, out: Any, layout: str) -> None:
    """The manager's invariants; the worker's rows equal the manager's for every
    scheduled request; attention rows cover every token the step computes. (vLLM's own
    manager, when hybridkv's scheduler falls back to it, answers ``get_block_ids`` too,
    with null blocks where it freed a state the worker's row still names.)"""
    scheduler.check_invariants()
    manager = scheduler.kv_cache_manager
    for req_id in out.num_scheduled_tokens:
        rows = worker.rows[req_id]
        held = manager.get_block_ids(req_id)
        if not scheduler.hybridkv_active:
            held = tuple(
                [w if m == 0 else m for w, m in zip(row, mine, strict=True)]
                for row, mine in zip(rows, held, strict=True)
            )
        assert tuple(rows) == held, req_id
        request = scheduler.requests[req_id]
        needed = -(-request.num_computed_tokens // BLOCK_SIZE)  # after the step
        assert len(rows[0]) >= needed, (req_id, len(rows[0]), needed)
        assert all(b > 0 for b in rows[0][:needed]), (req_id, rows[0])  # full: no nulls


def answer(
    scheduler: Any, out: Any, accept: Callable[[Any, int], int] = lambda r, n: n
) -> tuple[dict[str, list[int]], Any]:
    """vLLM's worker's output for ``out``: every request whose scheduled tokens reach its
    end samples ``accept(request, drafts) + 1`` tokens (the accepted drafts and one more);
    a prefill chunk samples nothing. Returns the sampled tokens per request and what
    ``update_from_output`` returned (the engine core's outputs per client)."""
    from vllm.v1.outputs import ModelRunnerOutput

    sampled: dict[str, list[int]] = {}
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
        if request.num_computed_tokens < request.num_tokens:
            sampled[req_id] = []  # a prefill chunk (scheduled tokens end before the last)
            continue
        num_accepted = accept(request, len(drafts))
        tokens = list(drafts[:num_accepted])
        sampled[req_id] = [*tokens, 100 + len(request.output_token_ids) % 800]
    req_ids = list(out.num_scheduled_tokens)
    engine_outputs = scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
        ),
    )
    return sampled, engine_outputs


def propose(scheduler: Any, drafts: dict[str, int]) -> None:
    """The drafter's proposals for the next step: ``drafts[req_id]`` tokens each."""
    from vllm.v1.outputs import DraftTokenIds

    req_ids = [r for r in drafts if r in scheduler.requests]
    scheduler.update_draft_token_ids(
        DraftTokenIds(
            req_ids=req_ids, draft_token_ids=[[7 + i for i in range(drafts[r])] for r in req_ids]
        )
    )


def check_drained(scheduler: Any, num_blocks: int) -> None:
    """No request left anywhere; every block but the null block free (cached or not)."""
    scheduler.schedule()  # commits the last executed step and frees what finished
    scheduler.check_invariants()
    assert not scheduler.requests
    manager = scheduler.kv_cache_manager
    assert manager.usage == 0.0
    if not scheduler.hybridkv_active:  # vLLM's own manager
        assert manager.block_pool.get_num_free_blocks() == num_blocks - 1
        return
    assert manager.cache.stats().num_requests == 0
    assert manager.cache.num_free_blocks(0) == num_blocks - 1


def run_to_end(
    scheduler: Any, worker: Worker, layout: str, max_steps: int = 400
) -> dict[str, list[int]]:
    """Schedule and answer until no request is left; every step checked. Returns every
    request's output tokens."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        out = scheduler.schedule()
        worker.apply(out)
        check_step(scheduler, worker, out, layout)
        for req_id, tokens in answer(scheduler, out)[0].items():
            outputs.setdefault(req_id, []).extend(tokens)
    raise AssertionError(f"requests still running after {max_steps} steps")


# ---------------------------------------------------------------------- #39271
PROMPT_55 = [i for i in range(3) for _ in range(BLOCK_SIZE)] + [3] * 7  # 3 blocks + 7
# drafts proposed and accepted per decode step: 16 with one accepted, then one (the
# issue's two rounds), then shrinking and growing across block boundaries
DRAFT_ROUNDS = [(16, 1), (1, 0), (0, 0), (5, 5), (16, 16), (3, 1), (0, 0), (16, 2), (2, 2)]


@pytest.mark.parametrize("layout", ["full", "sliding", "hybrid"])
def test_dynamic_draft_counts(model_dir: Path, layout: str) -> None:
    """vLLM #39271's scenario through the scheduler on hybridkv's manager: the draft count
    shrinks and grows every step (16 -> 1 -> 0 -> 5 -> 16 ..., 15 at most on the hybrid).
    Nothing raises, rows stay consistent, the accepted drafts are the request's tokens,
    every block returns."""
    num_blocks = 30
    k = BLOCK_SIZE - 1 if layout == "hybrid" else 16
    scheduler = build_scheduler(model_dir, layout, num_blocks=num_blocks, num_spec_tokens=k)
    assert scheduler.hybridkv_active
    worker = Worker()
    request = make_request("0", PROMPT_55, max_tokens=200)
    scheduler.add_request(request)
    chunks = []
    while not request.output_token_ids:  # the prompt (one chunk, or two split at 48)
        out = scheduler.schedule()
        worker.apply(out)
        check_step(scheduler, worker, out, layout)
        chunks.append(out.num_scheduled_tokens["0"])
        answer(scheduler, out)
    assert chunks in ([len(PROMPT_55)], [48, len(PROMPT_55) - 48])
    expected = len(PROMPT_55) + 1
    for num_drafts, num_accepted in DRAFT_ROUNDS:
        num_drafts, num_accepted = min(num_drafts, k), min(num_accepted, k)
        propose(scheduler, {"0": num_drafts})
        out = scheduler.schedule()
        worker.apply(out)
        check_step(scheduler, worker, out, layout)
        assert out.num_scheduled_tokens == {"0": 1 + num_drafts}
        assert len(out.scheduled_spec_decode_tokens.get("0", [])) == num_drafts
        sampled, _ = answer(scheduler, out, lambda r, n, k=num_accepted: k)
        assert len(sampled["0"]) == num_accepted + 1
        expected += num_accepted + 1
        assert request.num_tokens == expected
        # vLLM rolled back the rejected drafts; hybridkv keeps exactly what was verified
        assert request.num_computed_tokens == expected - 1
    scheduler.finish_requests("0", _aborted())
    check_drained(scheduler, num_blocks)


def test_hybrid_with_drafts_keeps_vllms_manager(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The #39271 configuration itself (Mamba align + full attention, 16 drafts on
    16-token blocks: one step's drafts may cross two state boundaries): hybridkv's
    scheduler leaves the KV cache to vLLM's own manager and logs the reason once; with 15
    drafts, or without drafts, the configuration is hybridkv's."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybridkv.vllm.kv_manager import VllmKVCacheManager

    hybridkv_logger = logging.getLogger("vllm.hybridkv")  # vLLM's loggers do not propagate
    hybridkv_logger.addHandler(caplog.handler)
    try:
        scheduler = build_scheduler(model_dir, "hybrid", num_blocks=30, num_spec_tokens=16)
    finally:
        hybridkv_logger.removeHandler(caplog.handler)
    assert not scheduler.hybridkv_active
    assert isinstance(scheduler.kv_cache_manager, KVCacheManager)
    reasons = {r.getMessage() for r in caplog.records if "speculative tokens" in r.getMessage()}
    assert len(reasons) == 1, [r.getMessage() for r in caplog.records]
    assert "vLLM's own KV-cache manager" in reasons.pop()
    for k in (0, BLOCK_SIZE - 1):
        plain = build_scheduler(model_dir, "hybrid", num_blocks=30, num_spec_tokens=k)
        assert plain.hybridkv_active and isinstance(plain.kv_cache_manager, VllmKVCacheManager)


def test_hybrid_align_prompt_and_decode(model_dir: Path) -> None:
    """The #39271 request without drafts on the hybrid config: the 55-token prompt is
    split on the state boundary (48 + 7), the state row holds the running state where
    vLLM's align-mode worker reads it, decode runs across block ends, blocks return."""
    num_blocks = 30
    scheduler = build_scheduler(model_dir, "hybrid", num_blocks=num_blocks)
    worker = Worker()
    scheduler.add_request(make_request("0", PROMPT_55, max_tokens=30))
    chunks = []
    for _ in range(2):
        out = scheduler.schedule()
        worker.apply(out)
        check_step(scheduler, worker, out, "hybrid")
        chunks.append(out.num_scheduled_tokens["0"])
        answer(scheduler, out)
    assert chunks == [48, 7]
    state_row = worker.rows["0"][1]
    # the state after 55 tokens runs in column ceil(55 / 16) - 1 = 3; columns before the
    # last checkpoint are null (never read)
    assert len(state_row) == 4 and state_row[3] > 0 and state_row[:2] == [0, 0]
    outputs = run_to_end(scheduler, worker, "hybrid")
    assert len(outputs["0"]) == 30 - 1  # the first token came with the prompt's last chunk
    check_drained(scheduler, num_blocks)


# ---------------------------------------------------------------------- prefix reuse
@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_second_request_hits_the_shared_prompt(model_dir: Path, layout: str) -> None:
    """A finished request's prompt is reused by a second one sharing its first 48 tokens:
    hybridkv reports the hit through ``get_computed_blocks``, the scheduler computes only
    the rest, and the new request's block ids start with the first one's blocks."""
    num_blocks = 60
    scheduler = build_scheduler(model_dir, layout, num_blocks=num_blocks)
    worker = Worker()
    manager = scheduler.kv_cache_manager
    hits: list[tuple[str, int]] = []
    lookup = manager.get_computed_blocks

    def spy(request: Any, *args: Any) -> Any:
        found = lookup(request, *args)
        hits.append((request.request_id, found[1]))
        return found

    manager.get_computed_blocks = spy
    first = make_request("a", PROMPT_55, max_tokens=4)
    scheduler.add_request(first)
    out = scheduler.schedule()
    worker.apply(out)
    rows_a = [list(r) for r in worker.rows["a"]]
    answer(scheduler, out)
    run_to_end(scheduler, worker, layout)
    shared = PROMPT_55[:48]
    second = make_request("b", [*shared, *range(500, 510)], max_tokens=3)
    scheduler.add_request(second)
    out = scheduler.schedule()
    worker.apply(out)
    check_step(scheduler, worker, out, layout)
    assert hits[-1] == ("b", 48)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 48
    assert out.num_scheduled_tokens["b"] == 10
    assert new.block_ids[0][:3] == rows_a[0][:3]
    if layout == "hybrid":
        # the state after 48 tokens: the block the first request's prefill chunk wrote
        # (column 2), read by the second request from the column vLLM's worker reads
        assert new.block_ids[1][2] == rows_a[1][2] > 0
    _, engine_outputs = answer(scheduler, out)
    (stats,) = [o.scheduler_stats.prefix_cache_stats for o in engine_outputs.values()]
    assert (stats.requests, stats.queries, stats.hits) == (1, len(second.prompt_token_ids), 48)
    run_to_end(scheduler, worker, layout)
    check_drained(scheduler, num_blocks)


# ---------------------------------------------------------------------- memory pressure
@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_preemption_under_a_tiny_pool_loses_nothing(model_dir: Path, layout: str) -> None:
    """Four requests that cannot all fit (12 blocks of 16 tokens, each needs up to 5 per
    group): vLLM preempts and resumes; every request still produces all its tokens, the
    rows stay consistent across preemption and resume, and every block returns."""
    num_blocks = 12
    scheduler = build_scheduler(model_dir, layout, num_blocks=num_blocks)
    worker = Worker()
    max_tokens = 36
    for i in range(4):
        prompt = [(i * 37 + j) % 900 + 10 for j in range(40)]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    outputs = run_to_end(scheduler, worker, layout, max_steps=1000)
    assert worker.num_preempted > 0
    assert sorted(outputs) == [f"r{i}" for i in range(4)]
    # a preempted request recomputes its tokens; the ones it sampled stay
    assert all(len(tokens) == max_tokens for tokens in outputs.values()), {
        r: len(t) for r, t in outputs.items()
    }
    check_drained(scheduler, num_blocks)


# ---------------------------------------------------------------------- finishing
def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize("layout", ["full", "sliding", "hybrid"])
def test_finished_and_aborted_requests_free_everything(model_dir: Path, layout: str) -> None:
    """Requests finishing at different steps (length), one aborted while running and
    one aborted while waiting: each leaves hybridkv's manager when vLLM frees it, and at
    the end no block is held."""
    num_blocks = 80
    scheduler = build_scheduler(model_dir, layout, num_blocks=num_blocks, max_num_seqs=3)
    worker = Worker()
    cache = scheduler.kv_cache_manager.cache
    for i, max_tokens in enumerate([3, 9, 20, 40, 5]):
        prompt = [(i * 53 + j) % 900 + 10 for j in range(20 + 7 * i)]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    aborted = False
    for step in itertools.count():
        if not scheduler.has_unfinished_requests():
            break
        assert step < 400
        running = {r.request_id for r in scheduler.running}
        if not aborted and "r3" in running and "r4" not in running:
            # r3 runs (the batch holds 3 requests), r4 still waits: abort both
            assert scheduler.requests["r4"].num_computed_tokens == 0
            scheduler.finish_requests(["r3", "r4"], _aborted())
            assert not cache.has_request("r3") and not cache.has_request("r4")
            aborted = True
        out = scheduler.schedule()
        worker.apply(out)
        check_step(scheduler, worker, out, layout)
        for req_id in out.finished_req_ids:
            assert not cache.has_request(req_id)
        answer(scheduler, out)
    assert aborted
    check_drained(scheduler, num_blocks)

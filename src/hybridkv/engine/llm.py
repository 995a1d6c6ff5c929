"""`LLM`: the reference engine end to end -- load a checkpoint, plan its cache, lay the
tensors out as planned, and generate with continuous batching, chunked prefill, prefix
caching and preemption, all through the real `CacheManager`.

    LLM(folder) -> load_model_spec + plan(...) -> CacheManager(plan) + build_cache_tensors
    generate(prompts) -> add requests -> step()* -> GenerationResult per prompt
    step():  Scheduler.schedule -> ModelRunner.execute -> sample -> CacheManager.commit
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.cache import CacheManager
from hybridkv.engine.models import load_model
from hybridkv.engine.runner import ModelRunner, StepInput
from hybridkv.engine.sampler import SamplingParams, make_generator, sample
from hybridkv.engine.scheduler import Request, ScheduledChunk, Scheduler, Status
from hybridkv.engine.tensors import build_cache_tensors, torch_dtype
from hybridkv.errors import EngineError
from hybridkv.models.registry import load_model_spec
from hybridkv.plan.planner import plan as make_plan
from hybridkv.plan.types import CachePlan, PlanOptions
from hybridkv.spec.dtypes import DType, parse_dtype
from hybridkv.spec.layers import STATE

DEFAULT_MEMORY_BYTES = 64 << 20  # tiny CPU models: plenty, and allocated eagerly
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class RequestStats:
    num_prompt_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    stats: RequestStats
    cancelled: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built. Prefix hits are in tokens, per group kind:
    ``attention`` counts hits served by attention groups, ``state`` hits where every
    state group restored a stored checkpoint (its read slot at the hit was set)."""

    num_steps: int
    num_preemptions: int
    num_scheduled_tokens: int
    prefix_hit_tokens: dict[str, int]
    num_checkpoints_stored: int
    num_checkpoints_used: int
    num_evictions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LLM:
    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        block_size: int | None = None,
        layout: str = "auto",
        prefix_caching: bool = True,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        chunk_size: int | None = None,
        max_model_len: int | None = None,
        **plan_options: Any,
    ) -> None:
        self.model_path = Path(model_path)
        cache_dtype = parse_dtype(dtype)
        self.torch_dtype = torch_dtype(cache_dtype)
        self.model = load_model(self.model_path, self.torch_dtype)
        spec = load_model_spec(self.model_path)
        if max_model_len is None:
            max_model_len = min(spec.max_position_embeddings or DEFAULT_MAX_MODEL_LEN,
                                DEFAULT_MAX_MODEL_LEN)
        options = PlanOptions(
            kv_dtype=cache_dtype,
            conv_dtype=cache_dtype,
            ssm_dtype=self._ssm_dtype(cache_dtype),
            memory_bytes=memory_bytes,
            block_size=block_size,
            layout=layout,
            prefix_caching=prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            **plan_options,
        )
        self.plan: CachePlan = make_plan(spec, None, options)
        self.manager = CacheManager(self.plan, enable_prefix_caching=prefix_caching)
        self.tensors = build_cache_tensors(self.plan, self.model.layers, self.torch_dtype)
        self.runner = ModelRunner(self.model, self.plan, self.manager, self.tensors)
        self.scheduler = Scheduler(
            self.manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
        )
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._ids = itertools.count()
        self._generators: dict[str, torch.Generator] = {}
        self._num_steps = self._num_tokens = 0
        self._hits = {"attention": 0, "state": 0}
        self._has_kind = {
            "attention": any(g.kind != STATE for g in self.plan.groups),
            "state": any(g.kind == STATE for g in self.plan.groups),
        }

    def _ssm_dtype(self, cache_dtype: DType) -> DType:
        """The model's ssm state dtype (a config may pin it, e.g. float32), else ours."""
        pinned = {d.ssm_dtype for d in self.model.layers if d.ssm_dtype is not None}
        if len(pinned) > 1:
            raise EngineError(f"state layers disagree on the ssm dtype: {sorted(map(str, pinned))}")
        return parse_dtype(str(pinned.pop())) if pinned else cache_dtype

    # ------------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self) -> Any:
        if not self._tokenizer_loaded:
            from hybridkv.engine.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
            self._tokenizer_loaded = True
        return self._tokenizer

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise EngineError(f"text prompt given but {self.model_path} has no tokenizer")
        return list(self.tokenizer.encode(prompt))

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt: Sequence[int] | str, params: SamplingParams, index: int = 0
    ) -> Request:
        tokens = self._encode(prompt)
        if not tokens:
            raise EngineError("empty prompt: needs >= 1 token")
        vocab = self.model.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"prompt token ids {bad[:5]} outside the vocabulary 0..{vocab - 1}")
        req = Request(f"req-{next(self._ids)}", index, tokens, params)
        if params.temperature > 0:
            self._generators[req.req_id] = make_generator(params.seed, index)
        self.scheduler.add(req)
        return req

    def cancel(self, req: Request) -> None:
        self.scheduler.cancel(req)
        self._generators.pop(req.req_id, None)

    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        chunks = self.scheduler.schedule()
        logits = self.runner.execute([self._step_input(c) for c in chunks])
        self._num_steps += 1
        finished = []
        for row, chunk in enumerate(chunks):
            req = chunk.request
            req.num_steps += 1
            self._num_tokens += chunk.num_new_tokens
            req.num_computed = chunk.num_computed + chunk.num_new_tokens
            if not chunk.samples:
                self.manager.commit(req.req_id)
                continue
            token = sample(logits[row], req.params.temperature, self._generators.get(req.req_id))
            req.output.append(token)
            self.manager.commit(req.req_id, 0, (token,))
            if req.done:
                self.scheduler.finish(req)
                self._generators.pop(req.req_id, None)
                finished.append(req)
        return finished

    def _step_input(self, chunk: ScheduledChunk) -> StepInput:
        req = chunk.request
        start = chunk.num_computed
        if chunk.prefix_hit:
            self._count_hit(req, chunk.prefix_hit)
        return StepInput(req.req_id, req.tokens[start : start + chunk.num_new_tokens], start)

    def _count_hit(self, req: Request, hit: int) -> None:
        if self._has_kind["attention"]:
            self._hits["attention"] += hit
        state_groups = [g.group_id for g in self.plan.groups if g.kind == STATE]
        if state_groups and all(
            self.manager.state_slots(req.req_id, g).read_block is not None for g in state_groups
        ):
            self._hits["state"] += hit

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> list[GenerationResult]:
        """Generate for every prompt (a batch under continuous batching), in order."""
        requests = [
            self.add_request(p, SamplingParams(max_new_tokens, temperature, seed), i)
            for i, p in enumerate(prompts)
        ]
        while any(r.status in (Status.WAITING, Status.RUNNING) for r in requests):
            self.step()
        return [self.result(r) for r in requests]

    def result(self, req: Request) -> GenerationResult:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output)
        return GenerationResult(
            request_id=req.req_id,
            prompt_token_ids=list(req.prompt),
            token_ids=list(req.output),
            text=text,
            stats=RequestStats(
                num_prompt_tokens=len(req.prompt),
                prefix_hit_tokens=req.prefix_hit_tokens,
                num_preemptions=req.num_preemptions,
                num_steps=req.num_steps,
            ),
            cancelled=req.status is Status.CANCELLED,
        )

    def stats(self) -> EngineStats:
        cache = self.manager.stats()
        return EngineStats(
            num_steps=self._num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_scheduled_tokens=self._num_tokens,
            prefix_hit_tokens=dict(self._hits),
            num_checkpoints_stored=cache.num_checkpoints_stored,
            num_checkpoints_used=cache.num_checkpoints_used,
            num_evictions=cache.num_evictions,
        )

"""`LLM`: the reference engine end to end -- load a checkpoint, plan its cache, lay the
tensors out as planned, and generate with continuous batching, chunked prefill, prefix
caching and preemption, all through the real `CacheManager`.

    LLM(folder) -> load_model_spec + plan(...) -> CacheManager(plan) + build_cache_tensors
    generate(prompts) -> add requests -> step()* -> GenerationResult per prompt
    step():  Scheduler.schedule -> ModelRunner.execute -> sample -> CacheManager.commit

Speculative decoding (`hybridkv.engine.speculative`): ``draft=FOLDER`` (a draft model
planned with its own groups), ``spec_method="ngram" | "suffix"`` or any `Proposer`
(``proposer=``); ``num_spec_tokens=K`` drafts at most per step. Then
    step():  schedule (reserve L drafts) -> draft model passes -> main verifies 1 + L
             tokens -> verify (greedy / speculative sampling) -> commit(a, a + 1 tokens)
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
from hybridkv.engine.proposers import Proposer
from hybridkv.engine.runner import ModelRunner, StepInput
from hybridkv.engine.sampler import SamplingParams, make_generator, sample
from hybridkv.engine.scheduler import Request, ScheduledChunk, Scheduler, Status
from hybridkv.engine.speculative import (
    DraftModelDrafter,
    Drafts,
    SpecCounters,
    make_proposer,
)
from hybridkv.engine.tensors import build_cache_tensors, torch_dtype
from hybridkv.engine.verify import Verdict, verify_greedy, verify_sampling
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
    """Per request. Speculative counters: drafts proposed / accepted, main-model steps
    that emitted tokens (``num_verify_steps``), ``mean_accepted_length`` = tokens emitted
    per verify step (accepted + 1), ``tokens_per_step`` = output tokens per main-model
    step the request took part in (prefill chunks included)."""

    num_prompt_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    mean_accepted_length: float = 0.0
    tokens_per_step: float = 0.0


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
    spec_method: str | None = None
    num_spec_tokens: int = 0
    num_output_tokens: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    acceptance_rate: float = 0.0  # accepted / proposed
    mean_accepted_length: float = 0.0  # (accepted + verify steps) / verify steps
    tokens_per_step: float = 0.0  # output tokens / main-model steps

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
        draft: str | Path | None = None,
        spec_method: str | None = None,
        num_spec_tokens: int = 0,
        proposer: Proposer | None = None,
        **plan_options: Any,
    ) -> None:
        self.model_path = Path(model_path)
        cache_dtype = parse_dtype(dtype)
        self.torch_dtype = torch_dtype(cache_dtype)
        self.model = load_model(self.model_path, self.torch_dtype)
        spec = load_model_spec(self.model_path)
        spec_method, num_spec_tokens = self._spec_setup(
            draft, spec_method, num_spec_tokens, proposer
        )
        self.draft_model = None
        draft_spec = None
        if draft is not None:
            self.draft_model = load_model(Path(draft), self.torch_dtype)
            draft_spec = load_model_spec(Path(draft))
            if self.draft_model.vocab_size != self.model.vocab_size:
                raise EngineError(
                    f"draft vocabulary {self.draft_model.vocab_size} != main vocabulary "
                    f"{self.model.vocab_size}; a draft model must share the tokenizer"
                )
        if max_model_len is None:
            max_model_len = min(
                spec.max_position_embeddings or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN
            )
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
            spec_method=spec_method,
            num_spec_tokens=num_spec_tokens,
            **plan_options,
        )
        self.plan: CachePlan = make_plan(spec, draft_spec, options)
        self.manager = CacheManager(self.plan, enable_prefix_caching=prefix_caching)
        self.tensors = build_cache_tensors(
            self.plan,
            self.model.layers,
            self.torch_dtype,
            draft_layers=None if self.draft_model is None else self.draft_model.layers,
        )
        self.runner = ModelRunner(self.model, self.plan, self.manager, self.tensors)
        self.spec_method = spec_method
        self.num_spec_tokens = num_spec_tokens
        self.drafter: DraftModelDrafter | None = None
        if self.draft_model is not None:
            self.drafter = DraftModelDrafter(
                ModelRunner(self.draft_model, self.plan, self.manager, self.tensors, "draft")
            )
        self.proposer: Proposer | None = proposer
        if proposer is None and spec_method is not None and draft is None:
            self.proposer = make_proposer(spec_method)
        self.scheduler = Scheduler(
            self.manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
            lookahead=self._lookahead if spec_method is not None else None,
        )
        self._drafts: dict[str, Drafts] = {}
        self._spec = SpecCounters()
        self._req_spec: dict[str, SpecCounters] = {}
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._ids = itertools.count()
        self._generators: dict[str, torch.Generator] = {}
        self._num_steps = self._num_tokens = self._num_output = 0
        self._hits = {"attention": 0, "state": 0}
        self._has_kind = {
            "attention": any(g.kind != STATE for g in self.plan.groups),
            "state": any(g.kind == STATE for g in self.plan.groups),
        }

    @staticmethod
    def _spec_setup(
        draft: str | Path | None,
        spec_method: str | None,
        num_spec_tokens: int,
        proposer: Proposer | None,
    ) -> tuple[str | None, int]:
        """(spec method, K) for planning; a custom proposer plans like n-gram."""
        if draft is not None and spec_method not in (None, "draft"):
            raise EngineError(f"a draft model needs spec_method 'draft', not {spec_method!r}")
        if draft is None and spec_method == "draft":
            raise EngineError("spec_method 'draft' needs a draft model (draft=FOLDER)")
        if draft is not None:
            spec_method = "draft"
        elif proposer is not None and spec_method is None:
            spec_method = "ngram"
        if spec_method is not None and num_spec_tokens < 1:
            raise EngineError(
                f"speculative decoding ({spec_method}) needs num_spec_tokens >= 1, got "
                f"{num_spec_tokens}"
            )
        if spec_method is None and num_spec_tokens:
            raise EngineError(f"num_spec_tokens={num_spec_tokens} needs a spec method or draft")
        return spec_method, num_spec_tokens

    def _ssm_dtype(self, cache_dtype: DType) -> DType:
        """The model's ssm state dtype (a config may pin it, e.g. float32), else ours."""
        layers = list(self.model.layers)
        if self.draft_model is not None:
            layers += list(self.draft_model.layers)
        pinned = {d.ssm_dtype for d in layers if d.ssm_dtype is not None}
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
        self._forget(req)

    def _forget(self, req: Request) -> None:
        self._generators.pop(req.req_id, None)
        self._drafts.pop(req.req_id, None)
        if self.proposer is not None:
            self.proposer.forget(req.req_id)

    def _lookahead(self, req: Request, budget: int) -> int:
        """Drafts to reserve for ``req``'s decode step (called by the scheduler)."""
        left = req.params.max_new_tokens - len(req.output) - 1  # the bonus token is extra
        limit = max(0, min(self.num_spec_tokens, left, budget))
        if self.proposer is None:  # draft model: it drafts after the allocation
            return limit
        drafts = self.proposer.propose(req.req_id, req.tokens, limit)[:limit] if limit else []
        self._drafts[req.req_id] = Drafts([int(t) for t in drafts])
        return len(drafts)

    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        chunks = self.scheduler.schedule()
        drafts: dict[str, Drafts] = {}
        if self.drafter is not None:
            temps = {c.request.req_id: c.request.params.temperature for c in chunks}
            drafts = self.drafter.run(chunks, temps, self._generators)
        else:
            for c in chunks:
                if c.num_lookahead:
                    drafts[c.request.req_id] = self._drafts.pop(c.request.req_id)
        logits = self.runner.execute([self._step_input(c, drafts) for c in chunks])
        self._num_steps += 1
        finished = []
        for chunk, rows in zip(chunks, logits, strict=True):
            req = chunk.request
            req.num_steps += 1
            self._num_tokens += chunk.num_new_tokens + chunk.num_lookahead
            if not chunk.samples:
                req.num_computed = chunk.num_computed + chunk.num_new_tokens
                self.manager.commit(req.req_id)
                continue
            verdict = self._verify(req, rows, drafts.get(req.req_id))
            req.num_computed = chunk.num_computed + chunk.num_new_tokens + verdict.num_accepted
            req.output.extend(verdict.token_ids)
            self._num_output += len(verdict.token_ids)
            self.manager.commit(req.req_id, verdict.num_accepted, verdict.token_ids)
            if self.spec_method is not None:
                num_proposed = chunk.num_lookahead
                self._spec.add(num_proposed, verdict.num_accepted)
                self._req_spec.setdefault(req.req_id, SpecCounters()).add(
                    num_proposed, verdict.num_accepted
                )
            if req.done:
                self.scheduler.finish(req)
                self._forget(req)
                finished.append(req)
        return finished

    def _verify(self, req: Request, logits: torch.Tensor, drafts: Drafts | None) -> Verdict:
        """Accepted drafts + one sampled token from the main model's ``[1 + L, vocab]``."""
        temperature = req.params.temperature
        generator = self._generators.get(req.req_id)
        if drafts is None or not drafts.token_ids:
            return Verdict(0, [sample(logits[-1], temperature, generator)])
        if temperature <= 0:
            return verify_greedy(logits, drafts.token_ids)
        assert generator is not None
        return verify_sampling(logits, drafts.token_ids, temperature, generator, drafts.probs)

    def _step_input(self, chunk: ScheduledChunk, drafts: dict[str, Drafts]) -> StepInput:
        req = chunk.request
        start = chunk.num_computed
        if chunk.prefix_hit:
            self._count_hit(req, chunk.prefix_hit)
        tokens = req.tokens[start : start + chunk.num_new_tokens]
        if not chunk.num_lookahead:
            return StepInput(req.req_id, tokens, start)
        draft_ids = drafts[req.req_id].token_ids
        if len(draft_ids) != chunk.num_lookahead:
            raise EngineError(
                f"request {req.req_id!r}: {len(draft_ids)} drafts for {chunk.num_lookahead} "
                "reserved positions"
            )
        return StepInput(req.req_id, [*tokens, *draft_ids], start, len(draft_ids))

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
        spec = self._req_spec.get(req.req_id, SpecCounters())
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
                num_proposed_tokens=spec.num_proposed,
                num_accepted_tokens=spec.num_accepted,
                num_verify_steps=spec.num_verify_steps,
                mean_accepted_length=spec.mean_accepted_length,
                tokens_per_step=len(req.output) / req.num_steps if req.num_steps else 0.0,
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
            spec_method=self.spec_method,
            num_spec_tokens=self.num_spec_tokens,
            num_output_tokens=self._num_output,
            num_proposed_tokens=self._spec.num_proposed,
            num_accepted_tokens=self._spec.num_accepted,
            num_verify_steps=self._spec.num_verify_steps,
            acceptance_rate=self._spec.acceptance_rate,
            mean_accepted_length=self._spec.mean_accepted_length,
            tokens_per_step=self._num_output / self._num_steps if self._num_steps else 0.0,
        )

"""`LLM`: the reference engine end to end -- load a checkpoint, plan its cache, lay the
tensors out as planned, and generate with continuous batching, chunked prefill, prefix
caching and preemption, all through the real `CacheManager`.

    LLM(folder, config) -> load_model_spec + plan(...) -> CacheManager(plan) + build_cache_tensors
    generate(prompts) -> add requests -> step()* -> GenerationResult per prompt
    step():  propose drafts -> Scheduler.schedule -> ModelRunner.execute -> verify ->
             Scheduler.update (cut, commit, emit)   (`hybridkv.sched`, `engine.stepper`)

What it is built with is one `EngineConfig` (`engine.config`), given as ``config=`` or
as keywords that build it; the names below are its fields.

``max_model_len`` (default: the checkpoint's ``max_position_embeddings``, at most 4096)
caps prompt + output tokens: `add_request` refuses a longer prompt (status ``refused``
with a reason, for a server's HTTP 400; `generate` raises `EngineError`), and a request
stops with ``finish_reason == "length"`` at the limit.

Speculative decoding (`hybridkv.engine.speculative.drafting`): ``draft=FOLDER`` (a draft model
planned with its own groups), ``spec_method="mtp"`` (the checkpoint's own MTP head),
``spec_method="eagle", draft=FOLDER`` (an EAGLE head, `hybridkv.engine.models.eagle`),
``spec_method="ngram" | "suffix"`` or any `Proposer` (``proposer=``);
``num_spec_tokens=K`` drafts at most per step; with a head, ``spec_topk=k`` or
``spec_tree=[[0], [1], [0, 0]]`` drafts a token tree of N nodes (`engine.speculative.tree`). Heads
are fed the main model's hidden states (`hybridkv.engine.speculative.proposers.head`). ``kv_dtype``
(default: ``dtype``) may be ``fp8_e4m3`` / ``fp8_e5m2``: fp8 KV pages
(`hybridkv.engine.ops.kv_quant`). Then
    step():  schedule (reserve L drafts) -> draft model passes -> main verifies 1 + L
             tokens -> verify (greedy / speculative sampling) -> commit(a, a + 1 tokens)

Stopping, as transformers' ``generate``: a request finishes after ``max_new_tokens``
or after emitting an EOS id of the checkpoint (``generation_config.json``, else
``config.json``; see `eos_token_ids`), unless ``ignore_eos``; ``stop_token_ids`` always
stop it. Tokens a verify step accepted after the stop token are dropped.

``device`` ("cpu", "cuda", "cuda:1", a `torch.device`) holds the weights, the cache pools
and every batch tensor; the Python side (scheduler, cache manager) stays on the host.

``torch_compile=True`` (off by default) compiles the elementwise chains of bf16 / fp16
prefill steps on the CPU (norms, the Gated DeltaNet output norm, the chunked delta
rule's per-chunk algebra; `engine.ops.compiled`), for the whole process. The first such
step of each new shape compiles (seconds to a minute): warm up before timing. float32
never takes those paths.

``keep_freed_pages=True`` (the default, CPU only) has glibc's malloc keep freed memory
for reuse, for the whole process (`engine.ops.scratch.keep_freed_pages`): a bf16 prefill step
otherwise touches tens of thousands of fresh pages. vLLM's CPU platform preloads tcmalloc
into its processes for the same reason. The cost: the process keeps its peak working set.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.cache import CacheManager
from hybridkv.engine.config import DEFAULT_MEMORY_BYTES, EngineConfig, EngineKeywords
from hybridkv.engine.forward.block_tables import DeviceBlockTables
from hybridkv.engine.forward.runner import ModelRunner
from hybridkv.engine.forward.tensors import build_cache_tensors, torch_dtype
from hybridkv.engine.llm_options import (
    DEFAULT_MAX_MODEL_LEN,
    parse_kv_dtype,
    per_prompt_salts,
    resolve_device,
    resolve_max_model_len,
    resolve_spec,
    resolve_ssm_dtype,
)
from hybridkv.engine.models import LayerDesc, load_model, load_mtp
from hybridkv.engine.models.loader import eos_token_ids
from hybridkv.engine.ops import compiled, scratch
from hybridkv.engine.results import EngineStats, GenerationResult, RequestStats, build_result
from hybridkv.engine.sampling.sampler import SamplingParams
from hybridkv.engine.speculative.drafting import (
    PROPOSER_METHODS,
    Drafter,
    DraftModelDrafter,
    SpecCounters,
    make_proposer,
)
from hybridkv.engine.speculative.proposers import Proposer
from hybridkv.engine.speculative.proposers.head import DraftHead, HeadDrafter
from hybridkv.engine.speculative.proposers.tree import TreeHeadDrafter
from hybridkv.engine.stepper import Stepper
from hybridkv.errors import EngineError
from hybridkv.models.registry import load_model_spec
from hybridkv.plan.planner import HEAD_METHODS
from hybridkv.plan.planner import plan as make_plan
from hybridkv.plan.tree import check_tree_drafts
from hybridkv.plan.types import CachePlan, PlanOptions
from hybridkv.sched import Request, Scheduler, Status, chunk_align_for
from hybridkv.spec.dtypes import DType, parse_dtype
from hybridkv.spec.model import ModelSpec

if TYPE_CHECKING:
    from typing_extensions import Unpack


class LLM:
    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig | None = None,
        **keywords: Unpack[EngineKeywords],
    ) -> None:
        """``LLM(folder, config=EngineConfig(...))``, or ``LLM(folder, **keywords)``
        (`EngineConfig.from_keywords`); not both."""
        if config is None:
            config = EngineConfig.from_keywords(**keywords)
        elif keywords:
            raise EngineError(
                f"LLM got config= and the keywords {sorted(keywords)}: pass one of them "
                "(dataclasses.replace(config, ...) changes a config)"
            )
        self.config = config
        if config.torch_compile:  # process-wide, bf16 / fp16 prefill-sized steps only
            compiled.enable()
        self.model_path = Path(model_path)
        self.device = resolve_device(config.device)
        # process-wide malloc settings; False where glibc is absent or refused
        self.keeps_freed_pages = (
            config.keep_freed_pages and self.device.type == "cpu" and scratch.keep_freed_pages()
        )
        cache_dtype = parse_dtype(config.dtype)
        self.torch_dtype = torch_dtype(cache_dtype)
        self.model = load_model(self.model_path, self.torch_dtype, self.device)
        self.eos_token_ids = eos_token_ids(self.model_path)
        spec = load_model_spec(self.model_path)
        # Trees (`plan.tree`): N nodes verified per step, planned as N speculative tokens.
        draft = config.draft
        method = config.spec_method or ("draft" if draft is not None else None)
        self.tree = check_tree_drafts(
            config.spec_topk,
            config.spec_tree,
            num_spec_tokens=config.num_spec_tokens,
            method=method,
        )
        num_spec_tokens = config.num_spec_tokens if self.tree is None else self.tree.num_nodes
        spec_method, num_spec_tokens = resolve_spec(
            draft, config.spec_method, num_spec_tokens, config.proposer
        )
        self.draft_model = None
        self.head: DraftHead | None = None
        draft_spec = None
        if spec_method in HEAD_METHODS:
            self.head, draft_spec = self._load_head(spec, spec_method, draft)
        elif draft is not None:
            self.draft_model = load_model(Path(draft), self.torch_dtype, self.device)
            draft_spec = load_model_spec(Path(draft))
            if self.draft_model.vocab_size != self.model.vocab_size:
                raise EngineError(
                    f"draft vocabulary {self.draft_model.vocab_size} != main vocabulary "
                    f"{self.model.vocab_size}; a draft model must share the tokenizer"
                )
        limits = config.scheduler
        max_model_len = resolve_max_model_len(limits.max_model_len, spec.max_position_embeddings)
        self.max_model_len = max_model_len
        plan_options = dict(config.plan_options)
        if config.block_size is not None:
            # the engine's attention reads whole blocks of any size: the 16-token unit the
            # planner holds a given block size to is the GPU kernels', not this engine's
            plan_options = {"block_align_tokens": 1, **plan_options}
        kv_dtype = config.kv_dtype
        options = PlanOptions(
            kv_dtype=cache_dtype if kv_dtype is None else parse_kv_dtype(kv_dtype),
            conv_dtype=cache_dtype,
            ssm_dtype=self._ssm_dtype(cache_dtype),
            memory_bytes=config.memory_bytes,
            block_size=config.block_size,
            layout=config.layout,
            prefix_caching=config.prefix_caching,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=max_model_len,
            spec_method=spec_method,
            num_spec_tokens=num_spec_tokens,
            **plan_options,
        )
        self.plan: CachePlan = make_plan(spec, draft_spec, options)
        # A head's KV at a position needs the token after it: groups holding head layers
        # key their blocks one token ahead (`GroupManager.key`).
        self.manager = CacheManager(
            self.plan,
            enable_prefix_caching=config.prefix_caching,
            eagle=self.head is not None,
            eviction_policy=config.eviction_policy,
            checkpoint_rules=config.checkpoint_rules,
        )
        self.tensors = build_cache_tensors(
            self.plan,
            self.model.layers,
            self.torch_dtype,
            device=self.device,
            draft_layers=self._draft_layers(),
        )
        # One set of device block tables for every runner, fed the scheduler's deltas.
        tables = DeviceBlockTables.for_plan(self.plan, self.device)
        self.runner = ModelRunner(self.model, self.plan, self.manager, self.tensors, tables=tables)
        self.spec_method = spec_method
        self.num_spec_tokens = num_spec_tokens
        drafter: Drafter | None = None
        if self.head is not None:
            # The runner only builds batches over the draft groups (the head runs itself).
            batches = ModelRunner(
                self.model, self.plan, self.manager, self.tensors, "draft", tables=tables
            )
            drafter = HeadDrafter(batches, self.head)
            if self.tree is not None:
                drafter = TreeHeadDrafter(drafter, self.tree)
        elif self.draft_model is not None:
            drafter = DraftModelDrafter(
                ModelRunner(
                    self.draft_model, self.plan, self.manager, self.tensors, "draft", tables=tables
                )
            )
        proposer = config.proposer
        if proposer is None and spec_method in PROPOSER_METHODS:
            proposer = make_proposer(spec_method)
        self.proposer: Proposer | None = proposer
        self.stepper = Stepper(
            self.plan,
            self.manager,
            self.runner,
            # the caller's limits, with what the engine derives (config module doc)
            config=dataclasses.replace(
                limits,
                max_model_len=max_model_len,
                max_spec_tokens=num_spec_tokens if spec_method is not None else 0,
                chunk_align_tokens=chunk_align_for(self.plan),
            ),
            spec_method=spec_method,
            num_spec_tokens=num_spec_tokens,
            drafter=drafter,
            proposer=proposer,
        )
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._ids = itertools.count()

    @property
    def scheduler(self) -> Scheduler:
        return self.stepper.scheduler

    def _load_head(
        self, spec: ModelSpec, method: str, draft: str | Path | None
    ) -> tuple[DraftHead, ModelSpec]:
        """The MTP head shipped with the main checkpoint, or the EAGLE head in ``draft``,
        and its layers as a draft `ModelSpec` (planned as draft layers)."""
        if method == "mtp":  # in the main checkpoint, or in its own folder (``draft``)
            head: DraftHead = load_mtp(self.model_path if draft is None else draft, self.model)
            return head, spec.draft_head(len(head.layers), method="mtp")
        from hybridkv.engine.models.eagle import load_eagle_head

        assert draft is not None  # _spec_setup refused eagle without a folder
        eagle = load_eagle_head(Path(draft), self.model)
        return eagle, eagle.model_spec(spec)

    def _draft_layers(self) -> list[LayerDesc] | None:
        if self.head is not None:
            return self.head.layers
        return None if self.draft_model is None else self.draft_model.layers

    def _ssm_dtype(self, cache_dtype: DType) -> DType:
        layers = list(self.model.layers)
        if self.draft_model is not None:
            layers += list(self.draft_model.layers)
        return resolve_ssm_dtype(layers, cache_dtype)

    # ------------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self) -> Any:
        if not self._tokenizer_loaded:
            from hybridkv.engine.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
            self._tokenizer_loaded = True
        return self._tokenizer

    def encode(self, prompt: Sequence[int] | str) -> list[int]:
        """The prompt's token ids as `add_request` sees them (text goes through the
        checkpoint's tokenizer; ids are passed through)."""
        return self._encode(prompt)

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise EngineError(f"text prompt given but {self.model_path} has no tokenizer")
        return list(self.tokenizer.encode(prompt))

    # ------------------------------------------------------------------ requests
    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) requests right now."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams,
        index: int = 0,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Queue one request (``index`` seeds its sampler). A prompt that leaves no room
        under ``max_model_len`` comes back with status ``refused``, ``finish_reason``
        ``"refused"`` and the reason in ``refusal``; nothing is queued then.
        ``cache_salt`` keys its prefix-cache blocks, so it only hits blocks computed
        under the same salt (per-tenant isolation; None is a salt of its own)."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise EngineError(f"cache_salt must be a string or None, got {cache_salt!r}")
        tokens = self._encode(prompt)
        if not tokens:
            raise EngineError("empty prompt: needs >= 1 token")
        vocab = self.model.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"prompt token ids {bad[:5]} outside the vocabulary 0..{vocab - 1}")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        req = Request(
            f"req-{next(self._ids)}",
            tokens,
            params.max_new_tokens,
            stop_token_ids=frozenset(stop),
            priority=priority,
            cache_salt=cache_salt,
            use_prefix_cache=params.prompt_logprobs is None,  # `SamplingParams` doc
        )
        self.stepper.add(req, params, index)
        return req

    def cancel(self, req: Request) -> None:
        self.stepper.cancel(req)

    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        return self.stepper.step()

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        *,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        cache_salt: str | Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (a batch under continuous batching), in order. Each
        stops after ``max_new_tokens``, or after its first EOS / stop token (module doc).
        ``cache_salt``: one salt for every prompt, or one per prompt (`add_request`)."""
        params = SamplingParams(
            max_new_tokens, temperature, seed, ignore_eos, tuple(int(t) for t in stop_token_ids)
        )
        salts = per_prompt_salts(cache_salt, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        for i, tokens in enumerate(encoded):
            if len(tokens) >= self.max_model_len:
                raise EngineError(
                    f"prompt {i} has {len(tokens)} tokens; max_model_len={self.max_model_len} "
                    f"leaves room for prompts of at most {self.max_model_len - 1} tokens"
                )
        requests = [
            self.add_request(p, params, i, cache_salt=salt)
            for i, (p, salt) in enumerate(zip(encoded, salts, strict=True))
        ]
        while any(r.status in (Status.WAITING, Status.RUNNING) for r in requests):
            self.step()
        return [self.result(r, release=True) for r in requests]

    def result(self, req: Request, *, release: bool = False) -> GenerationResult:
        """``req``'s result so far; ``release=True`` (once it finished) also drops the
        logprobs kept for it, so the engine holds nothing more of it."""
        spec = self.stepper.req_spec.get(req.req_id, SpecCounters())
        logprobs, prompt_logprobs = self.stepper.logprobs.get(req.req_id, len(req.prompt))
        if release:
            self.stepper.logprobs.pop(req.req_id)
        return build_result(req, spec, self.tokenizer, logprobs, prompt_logprobs)

    def stats(self) -> EngineStats:
        cache = self.manager.stats()
        loop = self.stepper
        return EngineStats(
            num_steps=loop.num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_scheduled_tokens=loop.num_tokens,
            prefix_hit_tokens=dict(loop.hits),
            num_checkpoints_stored=cache.num_checkpoints_stored,
            num_checkpoints_used=cache.num_checkpoints_used,
            num_evictions=cache.num_evictions,
            spec_method=self.spec_method,
            num_spec_tokens=self.num_spec_tokens,
            num_output_tokens=loop.num_output,
            num_proposed_tokens=loop.spec.num_proposed,
            num_accepted_tokens=loop.spec.num_accepted,
            num_verify_steps=loop.spec.num_verify_steps,
            acceptance_rate=loop.spec.acceptance_rate,
            mean_accepted_length=loop.spec.mean_accepted_length,
            tokens_per_step=loop.num_output / loop.num_steps if loop.num_steps else 0.0,
        )


__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_MEMORY_BYTES",
    "LLM",
    "EngineStats",
    "GenerationResult",
    "RequestStats",
    "parse_kv_dtype",
    "per_prompt_salts",
    "resolve_device",
]

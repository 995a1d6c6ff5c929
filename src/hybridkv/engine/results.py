"""What `LLM` hands back: per-request results and counters, and engine-wide counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.sched import Request, Status

if TYPE_CHECKING:
    from hybridkv.engine.sampling.logprobs import TokenLogprob
    from hybridkv.engine.speculative.drafting import SpecCounters


@dataclass(frozen=True)
class RequestStats:
    """Per request. Speculative counters: drafts proposed / accepted, main-model steps
    that emitted tokens (``num_verify_steps``), ``mean_accepted_length`` = tokens emitted
    per verify step (accepted + 1), ``tokens_per_step`` = output tokens per main-model
    step the request took part in (prefill chunks included). Drafts accepted after a
    stop token are not emitted and not counted as accepted."""

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
    """``token_ids`` include the stop token when ``finish_reason`` is "stop" (as
    transformers' output does); "length" means ``max_new_tokens`` were generated and
    None that the request was cancelled first. ``logprobs`` (one per output token) and
    ``prompt_logprobs`` (one per prompt token, None for the first) are set when the
    sampling params asked for them (`hybridkv.engine.sampling.logprobs`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    stats: RequestStats
    cancelled: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

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


def build_result(
    req: Request,
    spec: SpecCounters,
    tokenizer: Any,
    logprobs: list[TokenLogprob] | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
) -> GenerationResult:
    """``req``'s `GenerationResult` (text decoded when there is a tokenizer), with its
    speculative counters ``spec`` and the logprobs recorded for it."""
    text = None if tokenizer is None else tokenizer.decode(req.output)
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
        finish_reason=req.finish_reason,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )

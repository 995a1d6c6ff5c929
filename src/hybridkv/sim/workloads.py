"""Seeded workload generators producing `TraceRequest` lists (deterministic per seed).

Kinds (``WORKLOADS``):

* ``chat``: multi-turn conversations that open with one of a few shared system
  prompts; turn t's prompt is the whole conversation so far plus a new user message,
  so it shares its prefix with turn t-1 (including turn t-1's output).
* ``agentic``: long sessions that grow turn by turn with large tool outputs; the
  context reaches tens of thousands of tokens.
* ``suffix``: coding requests over a few shared repository contexts, with suffix-decoding
  draft patterns: runs of "copying" steps proposing up to K drafts and mostly accepting
  them, alternating with "novel" steps proposing 0..2, so the draft count jumps between
  0 and K from one step to the next.
* ``documents``: many users asking short questions about a few long shared documents.
* ``fewshot``: many short questions behind a few shared few-shot prompts (1-3K tokens).
* ``roundrobin``: ``num_sessions`` long sessions (a private context each) served in
  turns, round robin: turn t of every session, then turn t + 1 of every session. Each
  turn's prompt is the session so far plus a new message, like ``chat``. When the cache
  cannot hold every session, LRU evicts each session just before its next turn (the
  cyclic-scan failure); the study uses it to measure eviction under pressure.

With ``max_drafts > 0`` every request gets a ``spec`` list (one ``[proposed, accepted]``
per decode step; see `hybridkv.sim.trace`). ``chat``, ``agentic`` and ``documents`` use
an n-gram-like pattern (uniform 0..K proposals, geometric acceptance); ``suffix`` uses
the bursty pattern above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv.errors import HybridKVError
from hybridkv.plan.types import check_num_spec_tokens
from hybridkv.sim.trace import SpecStep, TraceRequest

VOCAB_SIZE = 32000
# Up-front bound on the tokens a workload may hold (worst case of its ranges): a Python
# token list costs ~36 bytes per token before the JSONL is written, so 50M tokens is
# about 2 GB. Larger traces are refused before anything is generated.
MAX_WORKLOAD_TOKENS = 50_000_000
MAX_RATE_PER_S = 1e6


class WorkloadError(HybridKVError, ValueError):
    """Workload options that are impossible or would not fit in memory."""


@dataclass(frozen=True, kw_only=True)
class WorkloadOptions:
    """Knobs shared by every generator; lengths are (low, high) token ranges, inclusive."""

    num_requests: int = 100
    seed: int = 0
    max_drafts: int = 0
    rate_per_s: float = 8.0  # Poisson arrivals of new conversations / requests
    output_len: tuple[int, int] = (32, 256)
    prefix_len: tuple[int, int] = (1024, 4096)  # system prompt / repository / document
    suffix_len: tuple[int, int] = (32, 512)  # user message / task / question / tool output
    num_prefixes: int = 4  # distinct shared prefixes
    max_turns: int = 6  # chat and agentic: turns per conversation (roundrobin: every one)
    num_sessions: int = 24  # roundrobin: sessions served in turn


class _Gen:
    """Random helpers over one numpy Generator (the only source of randomness)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def length(self, bounds: tuple[int, int]) -> int:
        low, high = bounds
        return int(self.rng.integers(low, high + 1))

    def tokens(self, num_tokens: int) -> list[int]:
        return self.rng.integers(0, VOCAB_SIZE, size=num_tokens).tolist()

    def gap_s(self, rate_per_s: float) -> float:
        return float(self.rng.exponential(1.0 / rate_per_s)) if rate_per_s > 0 else 0.0


def ngram_spec(gen: _Gen, num_output: int, max_drafts: int) -> tuple[SpecStep, ...]:
    """Uniform 0..K proposals; each draft accepted with p=0.6 until the first reject."""
    steps: list[SpecStep] = []
    emitted = 1
    while emitted < num_output:
        proposed = int(gen.rng.integers(0, max_drafts + 1))
        accepted = 0
        while accepted < proposed and gen.rng.random() < 0.6:
            accepted += 1
        steps.append((proposed, accepted))
        emitted += accepted + 1
    return tuple(steps)


def suffix_spec(gen: _Gen, num_output: int, max_drafts: int) -> tuple[SpecStep, ...]:
    """Bursty suffix-decoding pattern: copy runs (up to K drafts, p=0.9) and novel runs."""
    steps: list[SpecStep] = []
    emitted = 1
    copying = bool(gen.rng.random() < 0.5)
    while emitted < num_output:
        if gen.rng.random() < 0.3:  # switch mode often so counts jump between 0 and K
            copying = not copying
        if copying:
            proposed = int(gen.rng.integers(max(1, max_drafts // 2), max_drafts + 1))
            p_accept = 0.9
        else:
            proposed = int(gen.rng.integers(0, min(2, max_drafts) + 1))
            p_accept = 0.3
        accepted = 0
        while accepted < proposed and gen.rng.random() < p_accept:
            accepted += 1
        steps.append((proposed, accepted))
        emitted += accepted + 1
    return tuple(steps)


def _request(
    gen: _Gen,
    opts: WorkloadOptions,
    req_id: str,
    arrival_s: float,
    prompt: list[int],
    spec_fn: Callable[[_Gen, int, int], tuple[SpecStep, ...]],
) -> TraceRequest:
    output = gen.tokens(gen.length(opts.output_len))
    spec = spec_fn(gen, len(output), opts.max_drafts) if opts.max_drafts > 0 else None
    return TraceRequest(
        id=req_id,
        arrival_s=round(arrival_s, 6),
        prompt=tuple(prompt),
        output=tuple(output),
        spec=spec,
    )


def _conversations(opts: WorkloadOptions, *, think_s: float, prefix: str) -> list[TraceRequest]:
    """Shared engine of ``chat`` and ``agentic``: conversations that grow turn by turn."""
    gen = _Gen(opts.seed)
    prefixes = [gen.tokens(gen.length(opts.prefix_len)) for _ in range(opts.num_prefixes)]
    requests: list[TraceRequest] = []
    start_s = 0.0
    conv = 0
    while len(requests) < opts.num_requests:
        start_s += gen.gap_s(opts.rate_per_s)
        context = list(prefixes[int(gen.rng.integers(0, len(prefixes)))])
        arrival_s = start_s
        for turn in range(int(gen.rng.integers(1, opts.max_turns + 1))):
            if len(requests) >= opts.num_requests:
                break
            context += gen.tokens(gen.length(opts.suffix_len))
            req = _request(gen, opts, f"{prefix}{conv}-t{turn}", arrival_s, context, ngram_spec)
            requests.append(req)
            context += list(req.output)
            arrival_s += think_s + 0.02 * len(req.output)  # time to read and reply
        conv += 1
    return sorted(requests, key=lambda r: (r.arrival_s, r.id))


def chat_workload(opts: WorkloadOptions) -> list[TraceRequest]:
    return _conversations(opts, think_s=5.0, prefix="chat")


def agentic_workload(opts: WorkloadOptions) -> list[TraceRequest]:
    return _conversations(opts, think_s=0.5, prefix="agent")


def _shared_prefix_requests(
    opts: WorkloadOptions,
    prefix: str,
    spec_fn: Callable[[_Gen, int, int], tuple[SpecStep, ...]],
) -> list[TraceRequest]:
    gen = _Gen(opts.seed)
    prefixes = [gen.tokens(gen.length(opts.prefix_len)) for _ in range(opts.num_prefixes)]
    requests: list[TraceRequest] = []
    arrival_s = 0.0
    for index in range(opts.num_requests):
        arrival_s += gen.gap_s(opts.rate_per_s)
        shared = prefixes[int(gen.rng.integers(0, len(prefixes)))]
        prompt = shared + gen.tokens(gen.length(opts.suffix_len))
        requests.append(_request(gen, opts, f"{prefix}{index}", arrival_s, prompt, spec_fn))
    return requests


def suffix_workload(opts: WorkloadOptions) -> list[TraceRequest]:
    return _shared_prefix_requests(opts, "code", suffix_spec)


def documents_workload(opts: WorkloadOptions) -> list[TraceRequest]:
    return _shared_prefix_requests(opts, "doc", ngram_spec)


def fewshot_workload(opts: WorkloadOptions) -> list[TraceRequest]:
    return _shared_prefix_requests(opts, "shot", ngram_spec)


def roundrobin_workload(opts: WorkloadOptions) -> list[TraceRequest]:
    """Sessions served in turns, one request at a time (``rate_per_s`` spaces them).

    Arrival order for 3 sessions, 2 turns: s0-t0 s1-t0 s2-t0 s0-t1 s1-t1 s2-t1; stops
    after ``num_requests`` requests.
    """
    gen = _Gen(opts.seed)
    contexts = [gen.tokens(gen.length(opts.prefix_len)) for _ in range(opts.num_sessions)]
    requests: list[TraceRequest] = []
    arrival_s = 0.0
    gap_s = 1.0 / opts.rate_per_s if opts.rate_per_s > 0 else 0.0
    for turn in range(opts.max_turns):
        for session, context in enumerate(contexts):
            if len(requests) >= opts.num_requests:
                return requests
            context += gen.tokens(gen.length(opts.suffix_len))
            req = _request(gen, opts, f"rr{session}-t{turn}", arrival_s, context, ngram_spec)
            requests.append(req)
            context += list(req.output)
            arrival_s += gap_s
    return requests


WORKLOADS: dict[str, Callable[[WorkloadOptions], list[TraceRequest]]] = {
    "chat": chat_workload,
    "agentic": agentic_workload,
    "suffix": suffix_workload,
    "documents": documents_workload,
    "fewshot": fewshot_workload,
    "roundrobin": roundrobin_workload,
}


# Per-kind defaults on top of `WorkloadOptions`' own: agentic tool outputs are long and
# sessions run ~10 turns (contexts reach ~30K tokens); documents are long and few.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "chat": {},
    "agentic": {"suffix_len": (512, 4096), "max_turns": 10, "prefix_len": (2048, 4096)},
    "suffix": {"prefix_len": (2048, 8192), "output_len": (64, 512)},
    "documents": {"prefix_len": (8192, 16384), "num_prefixes": 3, "suffix_len": (16, 128)},
    "fewshot": {"prefix_len": (1024, 3072), "num_prefixes": 8, "suffix_len": (16, 256)},
    "roundrobin": {
        "prefix_len": (4096, 8192),
        "suffix_len": (128, 512),
        "output_len": (64, 256),
        "max_turns": 6,
        "num_requests": 144,
        "rate_per_s": 0.2,
    },
}


def workload_options(kind: str, **overrides: Any) -> WorkloadOptions:
    """`WorkloadOptions` with ``kind``'s defaults, then every non-None override."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload kind {kind!r}; use one of {', '.join(WORKLOADS)}")
    values = dict(KIND_DEFAULTS[kind])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return dataclasses.replace(WorkloadOptions(), **values)


def generate_workload(kind: str, opts: WorkloadOptions) -> list[TraceRequest]:
    """Requests of workload ``kind`` (one of `WORKLOADS`), deterministic in ``opts.seed``."""
    try:
        generator = WORKLOADS[kind]
    except KeyError:
        raise ValueError(
            f"unknown workload kind {kind!r}; use one of {', '.join(WORKLOADS)}"
        ) from None
    check_workload_options(kind, opts)
    return generator(opts)


def worst_case_tokens(kind: str, opts: WorkloadOptions) -> int:
    """An upper bound on the tokens ``kind`` generates under ``opts`` (prompt + output
    of every request plus the shared prefixes), from the high ends of the ranges."""
    prefix, suffix, output = opts.prefix_len[1], opts.suffix_len[1], opts.output_len[1]
    if kind in ("chat", "agentic", "roundrobin"):  # a turn's prompt: the session so far
        per_request = prefix + opts.max_turns * (suffix + output)
    else:
        per_request = prefix + suffix + output
    num_contexts = opts.num_sessions if kind == "roundrobin" else opts.num_prefixes
    return num_contexts * prefix + opts.num_requests * per_request


def check_workload_options(kind: str, opts: WorkloadOptions) -> None:
    """Refuse impossible options and workloads above `MAX_WORKLOAD_TOKENS`, up front."""

    def whole(name: str, value: object, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise WorkloadError(f"{name}={value!r} must be an integer >= {low}")
        return value

    whole("num_requests", opts.num_requests, 1)  # `simulate` refuses an empty trace
    whole("num_prefixes", opts.num_prefixes, 1)
    whole("max_turns", opts.max_turns, 1)
    whole("num_sessions", opts.num_sessions, 1)
    check_num_spec_tokens(opts.max_drafts, "max_drafts")  # the K limit of every command
    if isinstance(opts.seed, bool) or not isinstance(opts.seed, int) or opts.seed < 0:
        raise WorkloadError(f"seed={opts.seed!r} must be an integer >= 0")
    rate = opts.rate_per_s
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1e6:
        raise WorkloadError(
            f"rate_per_s={rate!r} must be a number of arrivals per second from 0 "
            f"(all at once) to {MAX_RATE_PER_S:.0e}"
        )
    for name in ("output_len", "prefix_len", "suffix_len"):
        low, high = getattr(opts, name)
        if not 1 <= low <= high:
            raise WorkloadError(f"{name}=({low}, {high}) needs 1 <= low <= high")
    bound = worst_case_tokens(kind, opts)
    if bound > MAX_WORKLOAD_TOKENS:
        raise WorkloadError(
            f"workload {kind!r} could hold up to {bound} tokens ({opts.num_requests} requests, "
            f"{opts.num_prefixes} prefixes of up to {opts.prefix_len[1]}, suffixes up to "
            f"{opts.suffix_len[1]}, outputs up to {opts.output_len[1]}"
            + (f", {opts.max_turns} turns" if kind in ("chat", "agentic") else "")
            + f"); the limit is {MAX_WORKLOAD_TOKENS}: lower --num-requests, --num-prefixes "
            "or the high ends of the length ranges"
        )

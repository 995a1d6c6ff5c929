"""A long-lived vLLM engine driven by JSON lines, for tests and benchmarks.

Run it with the python of a virtualenv that has vLLM (``scripts/install_vllm_cpu.sh``)::

    VLLM_PLUGINS=hybridkv python -m hybridkv.vllm.harness '{"model": "DIR", ...}'   # plugin
    VLLM_PLUGINS=none     python -m hybridkv.vllm.harness '{"model": "DIR", ...}'   # stock

The argument holds the engine's settings (see `ENGINE_DEFAULTS`); vLLM's
``VLLM_PLUGINS`` decides whether hybridkv's plugin loads, so both sides run the same
code. Each stdin line is one command; each answer is one stdout line starting with
``HKV `` and a JSON object (vLLM's own log goes to stderr):

* ``{"op": "generate", "prompts": [[ids]], "max_tokens": N, "reset": true}`` -> token ids
  out, ``num_cached_tokens`` per request, seconds (the whole ``LLM.generate`` call);
  in process and with speculative decoding also ``drafts``: per request, the draft
  tokens of every step the scheduler gave it (what the drafter proposed, in order).
* ``{"op": "chat", "sessions": S, "turns": T, "first_tokens": F, "user_tokens": U,
  "max_tokens": N, "seed": 0}`` -> multi-turn chat: every session's next prompt is its
  previous prompt + the reply + U new tokens; per turn, the prefix-hit tokens vLLM reports
  and the token-exact bound (the previous context minus its last token, whose KV the
  previous turn never computed), and the seconds of each turn's ``generate``. Optional:
  ``"system_tokens": K`` opens every session's first prompt with the same K tokens (a
  shared system prompt; a shorter first prompt takes its head), and ``first_tokens``
  may be a list (one first-prompt length per session, system tokens included).
* ``{"op": "sched"}`` -> the scheduler's class, its CPU seconds in ``schedule()`` and
  ``update_from_output()``, the number of steps and preemptions since the last ``sched``, and its
  KV-cache state (blocks in use, running / waiting requests; hybridkv's scheduler also
  runs its invariant checks). Needs ``"in_process": true`` in the settings (vLLM's
  engine core in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
* ``{"op": "spec"}`` -> vLLM's speculative-decoding counters since start (``drafts``,
  ``draft_tokens``, ``accepted_tokens``; zeros without drafts). Needs
  ``"disable_log_stats": false`` in the settings (the counters are vLLM's stats).
* ``{"op": "events", "reset": false}`` -> the KV-cache events vLLM's scheduler published
  since the last ``events`` (``batches``: each as a subscriber decodes it), every prefix
  lookup (``lookups``: request id, events published before it, the hit, the token ids),
  the lookup that admitted each request (``admitted``: request id -> index into
  ``lookups``), the groups' metadata (vLLM's ``get_kv_cache_group_metadata``) and vLLM's
  ``hash_block_size``. Needs ``"in_process": true`` and ``"kv_events_config"``.
* ``{"op": "quit"}``.

The prompts are random token ids (seeded), so any checkpoint of any vocabulary works.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",  # vLLM's CPU Gated DeltaNet kernels need bf16
    "max_model_len": 2048,
    "max_num_seqs": 64,
    "enable_prefix_caching": True,
    "enforce_eager": True,  # no torch.compile warm-up (~70 s); the tests time nothing
    "seed": 0,
    "skip_tokenizer_init": True,
}
MARK = "HKV "


def _answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _generate(
    llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None
) -> tuple[list[Any], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=logprobs
    )
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return outs, time.perf_counter() - start


def _chat(llm: Any, cmd: dict[str, Any], vocab: int) -> dict[str, Any]:
    rng = random.Random(cmd.get("seed", 0))
    sessions, turns = int(cmd["sessions"]), int(cmd["turns"])
    user, max_tokens = int(cmd["user_tokens"]), int(cmd["max_tokens"])

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    system = fresh(int(cmd.get("system_tokens", 0)))
    first = cmd["first_tokens"]
    lengths = [int(n) for n in first] if isinstance(first, list) else [int(first)] * sessions
    prompts = [system[:n] + fresh(n - len(system[:n])) for n in lengths]
    bounds = [0] * sessions
    per_turn = []
    logprobs = cmd.get("logprobs")
    for _ in range(turns):
        outs, seconds = _generate(llm, prompts, max_tokens, logprobs)
        turn: dict[str, Any] = {
            "seconds": seconds,
            "prompt_tokens": sum(len(p) for p in prompts),
            "hit_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "bound_tokens": sum(bounds),
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens or 0 for o in outs],
            "request_ids": [o.request_id for o in outs],
        }
        if logprobs:  # the first generated position's top tokens, per session
            turn["first_logprobs"] = [
                {str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs
            ]
        per_turn.append(turn)
        bounds = [
            len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outs, strict=True)
        ]
        prompts = [
            p + list(o.outputs[0].token_ids) + fresh(user)
            for p, o in zip(prompts, outs, strict=True)
        ]
    return {"turns": per_turn}


class SchedTimer:
    """Process-thread CPU time of a scheduler's ``schedule`` and ``update_from_output``
    (wrapped on the instance; the same for stock vLLM and hybridkv's scheduler), and the
    draft tokens each schedule gave each request."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.schedule_s = self.update_s = 0.0
        self.steps = 0
        self.drafts: dict[str, list[list[int]]] = {}
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                out = schedule(*args, **kwargs)
            finally:
                self.schedule_s += time.thread_time() - t
                self.steps += 1
            spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
            for req_id, tokens in spec.items():
                self.drafts.setdefault(req_id, []).append([int(t) for t in tokens])
            return out

        def timed_update(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return update(*args, **kwargs)
            finally:
                self.update_s += time.thread_time() - t

        scheduler.schedule = timed_schedule
        scheduler.update_from_output = timed_update
        self.preemptions = 0
        preempt = getattr(scheduler, "_preempt_request", None)
        if preempt is not None:

            def counted_preempt(*args: Any, **kwargs: Any) -> Any:
                self.preemptions += 1
                return preempt(*args, **kwargs)

            scheduler._preempt_request = counted_preempt

    def take_drafts(self, request_id: str) -> list[list[int]]:
        """The drafts of one request (vLLM's engine may suffix its ids: ``ID-xxxx``)."""
        keys = [k for k in self.drafts if k == request_id or k.startswith(request_id + "-")]
        return [d for k in keys for d in self.drafts.pop(k)]

    def take(self) -> dict[str, Any]:
        s = self.scheduler
        out: dict[str, Any] = {
            "class": f"{type(s).__module__}.{type(s).__qualname__}",
            "schedule_s": self.schedule_s,
            "update_s": self.update_s,
            "steps": self.steps,
            "usage": s.kv_cache_manager.usage,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "preemptions": self.preemptions,
        }
        out["hybridkv_active"] = bool(getattr(s, "hybridkv_active", False))
        if out["hybridkv_active"]:
            s.check_invariants()
            cache = s.kv_cache_manager.cache
            out["free_blocks"] = cache.num_free_blocks(0)
            out["num_blocks"] = cache.plan.pools[0].num_pages
            out["hybridkv_requests"] = cache.stats().num_requests
            out["hit_tokens"] = cache.stats().num_hit_tokens
        self.schedule_s = self.update_s = 0.0
        self.steps = self.preemptions = 0
        return out


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def _spec_counts(llm: Any) -> dict[str, int]:
    from vllm.v1.metrics.reader import Counter

    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for metric in llm.get_metrics():  # one counter per engine (label), summed
        if isinstance(metric, Counter) and metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += metric.value
    return counts


class EventTap:
    """KV-cache events as vLLM's scheduler publishes them (after its publisher stamped
    the data-parallel rank; msgpack round trip, as a subscriber reads them), and each
    prefix lookup with the number of events taken before it: the stream up to there is
    what the lookup saw. Events a lookup takes early join the step's batch as usual."""

    def __init__(self, scheduler: Any) -> None:
        import msgspec

        manager, publisher = scheduler.kv_cache_manager, scheduler.kv_event_publisher
        take, lookup, allocate = (
            manager.take_events,
            manager.get_computed_blocks,
            manager.allocate_slots,
        )
        publish = publisher.publish
        self.batches: list[Any] = []
        self.lookups: list[list[Any]] = []
        self.admitted: dict[str, int] = {}
        self.num_taken = 0
        self.hash_block_size = int(scheduler.hash_block_size)
        early: list[Any] = []

        def drain() -> list[Any]:
            events = take() or []
            self.num_taken += len(events)
            return events

        def tapped_lookup(request: Any, *args: Any, **kwargs: Any) -> Any:
            early.extend(drain())
            out = lookup(request, *args, **kwargs)
            tokens = list(request.all_token_ids)
            self.lookups.append([request.request_id, self.num_taken, int(out[1]), tokens])
            return out

        def tapped_allocate(request: Any, *args: Any, **kwargs: Any) -> Any:
            out = allocate(request, *args, **kwargs)
            req_id = request.request_id
            if out is not None and req_id not in self.admitted:  # its first allocation
                mine = [i for i, looked in enumerate(self.lookups) if looked[0] == req_id]
                self.admitted[req_id] = mine[-1] if mine else -1
            return out

        def tapped_take() -> list[Any]:
            events = early + drain()
            early.clear()
            return events

        def tapped_publish(batch: Any) -> None:
            publish(batch)
            self.batches.append(msgspec.msgpack.decode(msgspec.msgpack.encode(batch)))

        manager.take_events, manager.get_computed_blocks = tapped_take, tapped_lookup
        manager.allocate_slots = tapped_allocate
        publisher.publish = tapped_publish

    def take(self, engine_core: Any) -> dict[str, Any]:
        out = {
            "batches": self.batches,
            "lookups": self.lookups,
            "admitted": self.admitted,
            "groups": engine_core.get_kv_cache_group_metadata(),
            "hash_block_size": self.hash_block_size,
            "num_taken": self.num_taken,
        }
        self.batches, self.lookups, self.admitted, self.num_taken = [], [], {}, 0
        return out


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def main() -> None:  # vLLM spawns its engine: keep all work under main()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; its default takes most RAM
    settings = {**ENGINE_DEFAULTS, **json.loads(sys.argv[1])}
    in_process = bool(settings.pop("in_process", False))
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    if isinstance(settings.get("kv_events_config"), dict):  # LLM() takes only the object
        from vllm.config import KVEventsConfig

        settings["kv_events_config"] = KVEventsConfig(**settings["kv_events_config"])
    start = time.perf_counter()
    llm = LLM(**settings)
    timer = SchedTimer(_scheduler(llm)) if in_process else None
    events_on = in_process and settings.get("kv_events_config") is not None
    tap = EventTap(_scheduler(llm)) if events_on else None
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    cache = llm.llm_engine.vllm_config.cache_config  # synced back from the engine core
    _answer(
        {
            "ready": True,
            "start_seconds": time.perf_counter() - start,
            "vocab": vocab,
            "num_blocks": cache.num_gpu_blocks,
            "block_size": cache.block_size,
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd.get("reset", True):
            llm.reset_prefix_cache()
        if cmd["op"] == "generate":
            outs, seconds = _generate(llm, cmd["prompts"], int(cmd["max_tokens"]))
            answer = {
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
                "request_ids": [o.request_id for o in outs],
                "seconds": seconds,
            }
            if timer is not None and timer.drafts:
                answer["drafts"] = [timer.take_drafts(o.request_id) for o in outs]
            _answer(answer)
        elif cmd["op"] == "chat":
            _answer(_chat(llm, cmd, vocab))
        elif cmd["op"] == "spec":
            stats_on = not settings.get("disable_log_stats", True)
            _answer(_spec_counts(llm) if stats_on else {"error": "needs disable_log_stats false"})
        elif cmd["op"] == "sched":
            _answer({"error": "needs in_process"} if timer is None else timer.take())
        elif cmd["op"] == "events":
            core = llm.llm_engine.engine_core.engine_core
            _answer({"error": "needs in_process and events"} if tap is None else tap.take(core))
        else:
            _answer({"error": f"unknown op {cmd['op']!r}"})


if __name__ == "__main__":
    main()

"""`hybridkv demo`: the whole system on the built-in demo models, in seconds on a CPU.

    plan      the demo pair (Qwen3.5 hybrid main + Qwen3 dense draft, K drafts) -> CachePlan
              (printed with `hybridkv.plan.report.render`, compared with vLLM's layout)
    serve     N code-like prompts sharing a Python header; request 0 runs first so the
              others, admitted once its prompt is cached, hit the prefix cache
    report    generated text, mean accepted length, tokens per main-model step, prefix
              hit rate, peak cache use

Each request stops after ``--max-new-tokens`` or at the checkpoint's EOS (the byte
tokenizer's 257, from ``config.json``), as transformers' ``generate`` would; no other
stop rule. The report says how many stopped at EOS.

torch is imported inside `run_demo`, so importing this module stays cheap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hybridkv.demo import (
    DEMO_DRAFT,
    DEMO_MAIN,
    DEMO_MAX_MODEL_LEN,
    DEMO_MEMORY_BYTES,
    DEMO_MTP,
    demo_prompts,
)
from hybridkv.plan.types import check_num_spec_tokens

DEMO_SPEC_METHODS = ("draft", "mtp")
MAX_DEMO_REQUESTS = 1024
PROMPT_TAIL_CHARS = 60  # the shared header is long; the report shows each prompt's end


@dataclass(frozen=True)
class DemoOptions:
    num_requests: int = 8
    max_new_tokens: int = 64
    num_spec_tokens: int = 4
    threads: int | None = None
    device: str = "cpu"
    spec_method: str = "draft"  # "draft": the demo draft model; "mtp": the demo MTP head
    spec_topk: int = 1  # > 1: a token tree of num_spec_tokens nodes (MTP head only)


def run_demo(options: DemoOptions, progress: bool = True) -> tuple[Any, dict[str, Any]]:
    """Serve the demo batch; returns (the `LLM`, the JSON-ready report)."""

    from hybridkv.engine.llm import LLM
    from hybridkv.engine.sampling.sampler import SamplingParams
    from hybridkv.engine.threads import apply_threads

    check_num_spec_tokens(options.num_spec_tokens, "--num-spec")  # every command's K limit
    if options.num_requests < 1 or options.max_new_tokens < 1 or options.num_spec_tokens < 1:
        raise ValueError("--num-requests, --max-new-tokens and --num-spec must be >= 1")
    if options.spec_method not in DEMO_SPEC_METHODS:
        raise ValueError(
            f"--spec-method {options.spec_method!r}: the demo runs {' or '.join(DEMO_SPEC_METHODS)}"
        )
    if options.num_requests > MAX_DEMO_REQUESTS:  # prompts are built up front
        raise ValueError(
            f"--num-requests={options.num_requests}: the demo serves at most {MAX_DEMO_REQUESTS}"
        )
    apply_threads(options.threads, (DEMO_MAIN, DEMO_DRAFT))  # tiny models: 1 thread
    start = time.perf_counter()
    mtp = options.spec_method == "mtp"
    llm = LLM(
        DEMO_MAIN,
        draft=DEMO_MTP if mtp else DEMO_DRAFT,
        spec_method=options.spec_method,
        num_spec_tokens=options.num_spec_tokens,
        spec_topk=options.spec_topk,
        memory_bytes=DEMO_MEMORY_BYTES,
        max_model_len=DEMO_MAX_MODEL_LEN,
        max_num_seqs=max(8, options.num_requests),
        max_num_batched_tokens=1024,
        device=options.device,
    )
    prompts = demo_prompts(options.num_requests)
    params = SamplingParams(options.max_new_tokens)
    total = options.num_requests * options.max_new_tokens
    first = llm.add_request(prompts[0], params, 0)
    requests = [first]
    peak_usage = 0.0

    def serve(advance: Any) -> None:
        nonlocal peak_usage
        done = 0
        while llm.scheduler.has_work:
            llm.step()
            peak_usage = max(peak_usage, llm.manager.usage())
            if len(requests) == 1 and first.num_computed >= len(first.prompt):
                # request 0's prompt is cached now: the others hit it
                requests.extend(
                    llm.add_request(p, params, i) for i, p in enumerate(prompts[1:], start=1)
                )
            # a request stopped at EOS leaves its remaining tokens to the bar
            now = sum(r.max_new_tokens if r.done else len(r.output) for r in requests)
            advance(now - done)
            done = now

    from hybridkv.progress import progress_bar

    with progress_bar("serving", total, quiet=not progress) as advance:
        serve(advance)
    wall_s = time.perf_counter() - start
    return llm, _report(llm, [llm.result(r) for r in requests], peak_usage, wall_s)


def _report(llm: Any, results: list[Any], peak_usage: float, wall_s: float) -> dict[str, Any]:
    plan = llm.plan
    stats = llm.stats()
    cache = llm.manager.stats()
    vllm = next((p for p in plan.alternatives if p.layout == "vllm"), None)
    return {
        "models": {
            "main": str(DEMO_MAIN),
            "draft": str(DEMO_MTP if llm.spec_method == "mtp" else DEMO_DRAFT),
        },
        "device": str(llm.device),
        "stop": {
            "eos_token_ids": list(llm.eos_token_ids),
            "num_stopped_at_eos": sum(r.finish_reason == "stop" for r in results),
        },
        "plan": {
            "layout": plan.layout,
            "memory_bytes": plan.memory_bytes,
            "waste_bytes": plan.waste_bytes,
            "max_concurrency": plan.capacity.max_concurrency,
            "groups": [
                {
                    "kind": g.kind,
                    "model": g.model,
                    "block_size": g.block_size,
                    "num_layers": len(g.layers),
                }
                for g in plan.groups
            ],
        },
        "vllm_layout": None
        if vllm is None
        else {
            "max_concurrency": vllm.capacity.max_concurrency,
            "waste_bytes": vllm.waste_bytes,
        },
        "outputs": [
            {
                "prompt": llm.tokenizer.decode(r.prompt_token_ids),
                "text": r.text,
                "num_tokens": len(r.token_ids),
                "finish_reason": r.finish_reason,
                "prefix_hit_tokens": r.stats.prefix_hit_tokens,
                "mean_accepted_length": r.stats.mean_accepted_length,
            }
            for r in results
        ],
        "spec": {
            "method": stats.spec_method,
            "num_spec_tokens": stats.num_spec_tokens,
            # the token tree's node paths (ranks from the root), None for a chain
            "tree": None if llm.tree is None else [list(p) for p in llm.tree.paths],
            "num_proposed_tokens": stats.num_proposed_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            "tokens_per_step": stats.tokens_per_step,
        },
        "prefix_cache": {
            "lookup_tokens": cache.num_lookup_tokens,
            "hit_tokens": cache.num_hit_tokens,
            "hit_rate": cache.hit_rate,
            "checkpoints_stored": cache.num_checkpoints_stored,
            "checkpoints_used": cache.num_checkpoints_used,
        },
        "memory": {
            "cache_bytes": llm.tensors.num_bytes,
            "peak_usage": peak_usage,
            "peak_bytes": int(peak_usage * plan.used_bytes),
        },
        "num_steps": stats.num_steps,
        "num_output_tokens": stats.num_output_tokens,
        "wall_s": wall_s,
    }


def print_report(llm: Any, report: dict[str, Any]) -> None:
    """Human-readable demo output (rich)."""
    from rich.console import Console

    from hybridkv.plan.report import format_bytes, render

    console = Console()
    header, footer = framing(report)
    console.rule("hybridkv demo")
    console.print(header, highlight=False)
    render(llm.plan, console)
    vllm = report["vllm_layout"]
    if vllm is not None:
        plan = report["plan"]
        console.print(
            f"vs vLLM's layout rule: {plan['max_concurrency']} vs {vllm['max_concurrency']} "
            f"requests at max length, padding {format_bytes(plan['waste_bytes'])} vs "
            f"{format_bytes(vllm['waste_bytes'])}"
        )
    for i, out in enumerate(report["outputs"]):
        console.rule(f"request {i} (prefix hit {out['prefix_hit_tokens']} tokens)")
        # labelled blocks, so that a log without colours still shows where the prompt
        # ends and the completion starts
        tail = out["prompt"][-PROMPT_TAIL_CHARS:]
        console.print(
            f"prompt (last {len(tail)} of {len(out['prompt'])} characters):",
            style="cyan",
            highlight=False,
        )
        console.print(tail, style="dim", highlight=False, markup=False)
        console.print(
            f">>> completion ({out['num_tokens']} tokens, finish: {out['finish_reason']}):",
            style="cyan",
            highlight=False,
        )
        console.print(out["text"], style="bold", highlight=False, markup=False)
    spec, cache, mem = report["spec"], report["prefix_cache"], report["memory"]
    shape = "" if spec["tree"] is None else f", a tree of {len(spec['tree'])} nodes"
    console.rule("summary")
    console.print(
        f"speculative decoding ({'MTP head' if spec['method'] == 'mtp' else 'draft model'}, "
        f"K={spec['num_spec_tokens']}{shape}): mean accepted "
        f"length {spec['mean_accepted_length']:.2f}, acceptance {spec['acceptance_rate']:.1%}, "
        f"{spec['tokens_per_step']:.2f} tokens per main-model step (whole batch)"
    )
    console.print(
        f"prefix cache: hit rate {cache['hit_rate']:.1%} ({cache['hit_tokens']} of "
        f"{cache['lookup_tokens']} prompt tokens), state checkpoints stored "
        f"{cache['checkpoints_stored']}, used {cache['checkpoints_used']}"
    )
    stop = report["stop"]
    console.print(
        f"stopping: at EOS {stop['eos_token_ids']} (as transformers) or max new tokens; "
        f"{stop['num_stopped_at_eos']} of {len(report['outputs'])} requests stopped at EOS"
    )
    console.print(
        f"memory: cache {format_bytes(mem['cache_bytes'])}, peak use {mem['peak_usage']:.1%} "
        f"({format_bytes(mem['peak_bytes'])}); {report['num_output_tokens']} tokens in "
        f"{report['num_steps']} steps, {report['wall_s']:.1f} s on {report['device']}"
    )
    console.rule()
    console.print(footer, highlight=False)


def framing(report: dict[str, Any]) -> tuple[str, str]:
    """The lines around the human-readable report (not in ``--json``): what a newcomer is
    looking at, that the text is poor by design, and where to go next."""
    drafter = "its own MTP head" if report["spec"]["method"] == "mtp" else "a tiny Qwen3 draft"
    header = (
        "A tiny byte-level Qwen3.5 hybrid shipped with the package (Gated DeltaNet and gated "
        f"attention layers), drafting with {drafter}, serves {len(report['outputs'])} "
        "requests that share one code prefix. Below: the cache plan (vLLM's rule beside "
        "it), each request's prompt end and completion, then the speculative-decoding, "
        "prefix-cache and memory numbers. The models are tiny and trained for minutes on "
        "Python's standard library: expect poor code; the numbers are the point."
    )
    footer = (
        "Next: hybridkv plan MODEL plans a real model (hybridkv models lists them), "
        "hybridkv serve demo --draft demo-draft serves these models over an "
        "OpenAI-compatible API, hybridkv demo --json prints these numbers as JSON; the "
        "models and their training: docs/demo.md."
    )
    return header, footer

"""`hybridkv generate` and `hybridkv demo`: registered on `hybridkv.cli.app` when the
engine is installed.

torch is imported inside the command, so `hybridkv plan` never pays for it.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hybridkv.cli.engine_options import (
    DeviceOpt,
    DraftOpt,
    DtypeOpt,
    EvictionOpt,
    KvDtypeOpt,
    MemoryOpt,
    NumSpecOpt,
    SpecConfigOpt,
    SpecMethodOpt,
    StateModeOpt,
    ThreadsOpt,
    TorchCompileOpt,
    engine_speculative_config,
)
from hybridkv.cli.options import parse_bytes
from hybridkv.cli.root import app, emit_json, run_guarded
from hybridkv.plan.types import check_num_spec_tokens


def parse_prompt_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; raises ValueError naming the bad entry."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            raise ValueError(f"{option} {text!r}: {part!r} is not an integer token id")
        ids.append(int(part))
    return ids


def load_llm(
    model: str,
    *,
    draft: str | None = None,
    spec_method: str | None = None,
    num_spec: int | None = None,
    memory: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    threads: int | None = None,
    kv_dtype: str | None = None,
    chunk_size: int | None = None,
    state_mode: str | None = None,
    eviction_policy: str | None = None,
    spec_tree: list[list[int]] | None = None,
    torch_compile: bool = False,
) -> Any:
    """The `LLM` of `generate` / `serve` flags: MODEL and ``--draft`` may name the demo
    models, ``--draft`` or ``--spec-method`` without ``--num-spec`` drafts 4 per step,
    ``threads`` as `hybridkv.engine.threads.apply_threads` chooses (None: by model size)."""
    from hybridkv.demo import resolve_model
    from hybridkv.engine.llm import DEFAULT_MEMORY_BYTES, LLM
    from hybridkv.engine.threads import apply_threads

    if num_spec is not None:  # before any checkpoint loads: the limit every command uses
        check_num_spec_tokens(num_spec, "--num-spec")
    budget = DEFAULT_MEMORY_BYTES if memory is None else parse_bytes(memory)
    folders = [resolve_model(name) for name in (model, draft) if name is not None]
    apply_threads(threads, folders)
    speculative = draft is not None or spec_method is not None
    num_spec_tokens = (4 if speculative else 0) if num_spec is None else num_spec
    extra: dict[str, Any] = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    if chunk_size is not None:
        extra["chunk_size"] = chunk_size
    if state_mode is not None:
        extra["state_mode"] = state_mode
    if eviction_policy is not None:
        extra["eviction_policy"] = eviction_policy
    if spec_tree is not None:  # a token tree of N nodes (`plan.tree`)
        extra["spec_tree"] = spec_tree
    return LLM(
        resolve_model(model),
        dtype=dtype,
        kv_dtype=None if kv_dtype in (None, "auto") else kv_dtype,
        memory_bytes=budget,
        draft=None if draft is None else resolve_model(draft),
        spec_method=spec_method,
        num_spec_tokens=num_spec_tokens,
        device=device,
        max_model_len=max_model_len,
        torch_compile=torch_compile,
        **extra,
    )


@app.command("generate")
def generate_command(
    model: Annotated[
        str,
        typer.Argument(help="checkpoint folder (config.json + safetensors), or demo / demo-draft"),
    ],
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="text prompt; repeat for a batch")
    ] = None,
    prompt_ids: Annotated[
        list[str] | None,
        typer.Option("--prompt-ids", help="comma-separated token ids; repeat for a batch"),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 16,
    temperature: Annotated[float, typer.Option("--temperature")] = 0.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    memory: MemoryOpt = None,
    dtype: DtypeOpt = "float32",
    kv_dtype: KvDtypeOpt = "auto",
    draft: DraftOpt = None,
    spec_method: SpecMethodOpt = None,
    num_spec: NumSpecOpt = None,
    speculative_config: SpecConfigOpt = None,
    device: DeviceOpt = "cpu",
    max_num_seqs: Annotated[
        int, typer.Option("--max-num-seqs", help="requests running at once (1: one by one)")
    ] = 16,
    chunk_size: Annotated[
        int | None, typer.Option("--chunk-size", help="prefill chunk (tokens); none: whole")
    ] = None,
    threads: ThreadsOpt = None,
    torch_compile: TorchCompileOpt = False,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="do not stop at the checkpoint's EOS id")
    ] = False,
    stop_token_ids: Annotated[
        str | None,
        typer.Option("--stop-token-ids", help="comma-separated ids that also stop a request"),
    ] = None,
    state_mode: StateModeOpt = None,
    eviction: EvictionOpt = "chain",
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Generate tokens with the reference engine (planned cache, real cache manager)."""

    def body() -> None:
        import torch

        if bool(prompt) == bool(prompt_ids):
            raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3 (one of them, repeatable)")
        method, folder, k, tree = engine_speculative_config(
            speculative_config, spec_method, draft, num_spec
        )
        llm = load_llm(
            model,
            draft=folder,
            spec_method=method,
            num_spec=k,
            spec_tree=tree,
            memory=memory,
            dtype=dtype,
            device=device,
            state_mode=state_mode,
            eviction_policy=eviction,
            threads=threads,
            max_num_seqs=max_num_seqs,
            chunk_size=chunk_size,
            kv_dtype=kv_dtype,
            torch_compile=torch_compile,
        )
        prompts: list[list[int] | str] = (
            list(prompt) if prompt else [parse_prompt_ids(p) for p in prompt_ids or []]
        )
        stop_ids = (
            [] if stop_token_ids is None else parse_prompt_ids(stop_token_ids, "--stop-token-ids")
        )
        results = llm.generate(
            prompts,
            max_new_tokens,
            temperature=temperature,
            seed=seed,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_ids,
        )
        if as_json:
            emit_json(
                {
                    "model": model,
                    "layout": llm.plan.layout,
                    "kv_dtype": str(llm.plan.options.kv_dtype),
                    "device": str(llm.device),
                    "torch_compile": torch_compile,
                    "threads": torch.get_num_threads(),
                    "eos_token_ids": list(llm.eos_token_ids),
                    "outputs": [
                        {
                            "prompt_token_ids": r.prompt_token_ids,
                            "token_ids": r.token_ids,
                            "text": r.text,
                            "finish_reason": r.finish_reason,
                            "stats": r.to_dict()["stats"],
                        }
                        for r in results
                    ],
                    "stats": llm.stats().to_dict(),
                }
            )
            return
        for i, r in enumerate(results):
            shown = r.text if r.text is not None else " ".join(map(str, r.token_ids))
            typer.echo(f"[{i}] {shown}")
        s = llm.stats()
        typer.echo(
            f"steps {s.num_steps}, preemptions {s.num_preemptions}, prefix hit tokens "
            f"{s.prefix_hit_tokens}",
            err=True,
        )
        if s.spec_method is not None:
            typer.echo(
                f"speculative ({s.spec_method}, K={s.num_spec_tokens}): proposed "
                f"{s.num_proposed_tokens}, accepted {s.num_accepted_tokens} "
                f"({s.acceptance_rate:.1%}), mean accepted length "
                f"{s.mean_accepted_length:.2f}, tokens per step {s.tokens_per_step:.2f}",
                err=True,
            )
            for i, r in enumerate(results):
                typer.echo(
                    f"  [{i}] proposed {r.stats.num_proposed_tokens}, accepted "
                    f"{r.stats.num_accepted_tokens}, mean accepted length "
                    f"{r.stats.mean_accepted_length:.2f}",
                    err=True,
                )

    run_guarded(as_json, body)


@app.command("demo")
def demo_command(
    num_requests: Annotated[int, typer.Option("--num-requests")] = 8,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    num_spec: Annotated[int, typer.Option("--num-spec", help="K: drafts per step")] = 4,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    spec_method: Annotated[
        str,
        typer.Option("--spec-method", help="draft (the demo draft model) or mtp (its MTP head)"),
    ] = "draft",
    spec_topk: Annotated[
        int,
        typer.Option(
            "--spec-topk",
            help="with --spec-method mtp: draft a token tree of --num-spec nodes, up to k "
            "children per node (docs/tree_drafts.md); 1: a chain",
        ),
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """The whole system on the built-in demo models: plan, serve a batch sharing a
    prefix with speculative decoding (demo draft), report acceptance, hits and memory."""

    def body() -> None:
        from hybridkv.cli.demo import DemoOptions, print_report, run_demo

        options = DemoOptions(
            num_requests, max_new_tokens, num_spec, threads, device, spec_method, spec_topk
        )
        llm, report = run_demo(options, progress=not as_json)
        if as_json:
            emit_json(report)
        else:
            print_report(llm, report)

    run_guarded(as_json, body)

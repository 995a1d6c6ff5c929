"""`hybridkv generate`: registered on `hybridkv.cli.app` when the engine is installed.

torch is imported inside the command, so `hybridkv plan` never pays for it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from hybridkv.cli import app, emit_json, run_guarded
from hybridkv.cli_options import parse_bytes


def parse_prompt_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; raises ValueError naming the bad entry."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            raise ValueError(f"--prompt-ids {text!r}: {part!r} is not an integer token id")
        ids.append(int(part))
    return ids


@app.command("generate")
def generate_command(
    model: Annotated[str, typer.Argument(help="checkpoint folder (config.json + safetensors)")],
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
    memory: Annotated[str | None, typer.Option("--memory", help="cache budget, e.g. 64MiB")] = None,
    dtype: Annotated[str, typer.Option("--dtype")] = "float32",
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Generate tokens with the reference engine (planned cache, real cache manager)."""

    def body() -> None:
        if bool(prompt) == bool(prompt_ids):
            raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3 (one of them, repeatable)")
        from hybridkv.engine.llm import DEFAULT_MEMORY_BYTES, LLM

        budget = DEFAULT_MEMORY_BYTES if memory is None else parse_bytes(memory)
        llm = LLM(model, dtype=dtype, memory_bytes=budget)
        prompts: list[list[int] | str] = (
            list(prompt) if prompt else [parse_prompt_ids(p) for p in prompt_ids or []]
        )
        results = llm.generate(prompts, max_new_tokens, temperature=temperature, seed=seed)
        if as_json:
            emit_json({
                "model": model,
                "layout": llm.plan.layout,
                "outputs": [
                    {"prompt_token_ids": r.prompt_token_ids, "token_ids": r.token_ids,
                     "text": r.text, "stats": r.to_dict()["stats"]}
                    for r in results
                ],
                "stats": llm.stats().to_dict(),
            })
            return
        for i, r in enumerate(results):
            shown = r.text if r.text is not None else " ".join(map(str, r.token_ids))
            typer.echo(f"[{i}] {shown}")
        s = llm.stats()
        typer.echo(
            f"steps {s.num_steps}, preemptions {s.num_preemptions}, prefix hit tokens "
            f"{s.prefix_hit_tokens}", err=True
        )

    run_guarded(as_json, body)

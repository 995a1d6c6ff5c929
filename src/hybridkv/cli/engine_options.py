"""Typer options that `hybridkv generate` and `hybridkv serve` share (one definition of
each flag, its vLLM alias and its help text)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from hybridkv.plan.tree import TREE_KEYS

THREADS_HELP = "torch CPU threads (default: 1 for models under 256 MiB, else torch's)"

MemoryOpt = Annotated[str | None, typer.Option("--memory", help="cache budget, e.g. 64MiB")]
DtypeOpt = Annotated[str, typer.Option("--dtype")]
KvDtypeOpt = Annotated[
    str,
    typer.Option(
        "--kv-dtype",
        "--kv-cache-dtype",
        help="KV page dtype: auto (= --dtype), fp8_e4m3, fp8_e5m2, bfloat16, ...",
    ),
]
DraftOpt = Annotated[
    str | None,
    typer.Option(
        "--draft",
        help="draft model folder (or demo-draft), an MTP head folder (or demo-mtp) with "
        "--spec-method mtp, or an EAGLE head with --spec-method eagle",
    ),
]
SpecMethodOpt = Annotated[
    str | None,
    typer.Option(
        "--spec-method",
        help="draft (--draft MODEL), mtp (the checkpoint's MTP head, or --draft), eagle "
        "(--draft EAGLE_FOLDER), ngram or suffix",
    ),
]
NumSpecOpt = Annotated[
    int | None,
    typer.Option("--num-spec", "--num-speculative-tokens", help="K: drafts per step at most"),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help=THREADS_HELP)]
TorchCompileOpt = Annotated[
    bool,
    typer.Option(
        "--torch-compile/--no-torch-compile",
        help="compile the bf16 / fp16 prefill steps, as bench/engine_vs_vllm.py measures "
        "the engine (LLM(torch_compile=True)); each new shape compiles on first use "
        "(seconds to a minute); float32 never takes those paths",
    ),
]
StateModeOpt = Annotated[
    str | None,
    typer.Option(
        "--state-mode", "--mamba-cache-mode", help="state checkpoints: align | all | none"
    ),
]
EvictionOpt = Annotated[
    str, typer.Option("--eviction", help="eviction policy of the prefix cache: lru | chain")
]
SpecConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--speculative-config",
        help="vLLM-style JSON: method, model, num_speculative_tokens, and topk or "
        "speculative_token_tree for tree drafts (mtp, eagle)",
    ),
]


def engine_speculative_config(
    text: str | None, method: str | None, draft: str | None, k: int | None
) -> tuple[str | None, str | None, int | None, list[list[int]] | None]:
    """``--speculative-config`` over the flags: (spec method, draft, K, token tree paths
    or None for a chain). A tree's K is its node count."""
    if text is None:
        return method, draft, k, None
    from hybridkv.cli.options import _normalize_method, parse_speculative_config, speculative_tree

    method, draft, k = parse_speculative_config(text, method, draft, k)
    method = _normalize_method(method)
    config = json.loads(text)
    tree = speculative_tree(config, method) if any(key in config for key in TREE_KEYS) else None
    return method, draft, k, None if tree is None else [list(p) for p in tree.paths]

"""`hybridkv` command line: thin wrappers over the public functions.

Every command takes ``--json``; failures exit with status 2 and a one-paragraph message
on stderr (and ``{"error": {...}}`` on stdout with ``--json``), never a traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv import cli_options as o
from hybridkv.errors import HybridKVError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Plan, manage and prove KV-cache / recurrent-state memory for hybrid LLMs.",
    pretty_exceptions_enable=False,
)

EXIT_USAGE = 2


def emit_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def run_guarded(as_json: bool, body: Callable[[], None]) -> None:
    """Run ``body``; turn every failure into exit status 2 with a readable message."""
    try:
        body()
    except (HybridKVError, ValueError, OSError, KeyError) as err:
        if os.environ.get("HYBRIDKV_DEBUG"):
            raise
        kind = type(err).__name__
        message = str(err) if not isinstance(err, KeyError) else f"missing key {err}"
        if as_json:
            emit_json({"error": {"type": kind, "message": message}})
        # escaped: messages hold brackets ("hybridkv[engine]", "[4, 2]") that rich would eat
        Console(stderr=True).print(f"[red]error ({kind}):[/red] {escape(message)}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    except typer.Exit:
        raise
    except Exception as err:  # a bug of ours: still no traceback for the user
        if os.environ.get("HYBRIDKV_DEBUG"):
            raise
        if as_json:
            emit_json({"error": {"type": "InternalError", "message": repr(err)}})
        Console(stderr=True).print(
            f"[red]internal error:[/red] {escape(repr(err))} (rerun with HYBRIDKV_DEBUG=1 for a "
            "traceback and please report it)",
            highlight=False,
        )
        raise typer.Exit(EXIT_USAGE) from None


@app.command("plan")
def plan_command(
    model: o.Model,
    draft: o.Draft = None,
    spec_method: o.SpecMethod = None,
    num_spec: o.NumSpec = 0,
    speculative_config: o.SpecConfig = None,
    kv_dtype: o.KvDtype = "auto",
    conv_dtype: o.ConvDtype = "auto",
    ssm_dtype: o.SsmDtype = "auto",
    memory: o.Memory = None,
    gpu_memory: o.GpuMemory = None,
    gpu_memory_utilization: o.GpuUtil = 0.9,
    tp: o.Tp = 1,
    max_model_len: o.MaxLen = None,
    max_num_seqs: o.MaxSeqs = 256,
    max_num_batched_tokens: o.MaxBatched = 8192,
    prefix_caching: o.PrefixCaching = True,
    state_mode: o.StateMode = None,
    layout: o.Layout = "auto",
    block_size: o.BlockSize = None,
    max_block_size: o.MaxBlockSize = None,
    target_len: o.TargetLen = None,
    typical_len: o.TypicalLen = None,
    as_json: o.Json = False,
) -> None:
    """Plan cache memory for MODEL (and an optional draft): groups, pools, capacity."""
    args = o.PlanArgs(**{k: v for k, v in locals().items() if k != "as_json"})

    def body() -> None:
        from hybridkv.plan import plan
        from hybridkv.plan.report import render

        main_spec, draft_spec, options = args.resolve()
        result = plan(main_spec, draft_spec, options)
        if as_json:
            emit_json(result.to_dict())
        else:
            render(result)

    run_guarded(as_json, body)


@app.command("models")
def models_command(as_json: o.Json = False) -> None:
    """List the built-in model presets (name, family, layer mix, source)."""

    def body() -> None:
        from hybridkv.models import list_presets

        presets = list_presets()
        if as_json:
            emit_json(
                [
                    {
                        "name": p.name,
                        "family": p.family,
                        "model_type": p.model_type,
                        "hf_id": p.hf_id,
                        "layer_mix": p.layer_mix,
                        "source": p.source,
                    }
                    for p in presets
                ]
            )
            return
        table = Table(title=f"{len(presets)} presets")
        for col in ("name", "family", "layer mix", "hf id"):
            table.add_column(col)
        for p in presets:
            table.add_row(p.name, p.family, p.layer_mix, p.hf_id)
        Console().print(table)

    run_guarded(as_json, body)


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_command(
    ctx: typer.Context,
    name: str = typer.Argument(help="a script in bench/ without .py, e.g. planner"),
) -> None:
    """Run one benchmark from the repository's bench/ folder (a source checkout)."""
    import runpy
    from pathlib import Path

    def body() -> None:
        root = Path(__file__).resolve().parents[2] / "bench"
        script = root / f"{name}.py"
        if not script.is_file():
            available = sorted(p.stem for p in root.glob("*.py") if not p.stem.startswith("_"))
            raise FileNotFoundError(
                f"no benchmark {name!r} in {root}; available: {', '.join(available) or 'none'}"
            )
        sys.argv = [str(script), *ctx.args]
        runpy.run_path(str(script), run_name="__main__")

    run_guarded(False, body)


def _register_optional_commands() -> None:
    """Commands whose modules may be absent in a partial install register themselves."""
    for module in ("hybridkv.sim.cli", "hybridkv.engine.cli", "hybridkv.serve.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = err.name or ""
            if module != missing and not module.startswith(missing + "."):
                raise  # a real import bug inside the module, not an absent module


def main() -> None:
    _register_optional_commands()
    app()


if __name__ == "__main__":
    main()

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
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv import cli_options as o
from hybridkv.errors import HybridKVError
from hybridkv.plan.report import LEGEND, short_kind

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Plan, manage and prove KV-cache / recurrent-state memory for hybrid LLMs.",
    pretty_exceptions_enable=False,
    # plain click help: rich's help panels cut option names ("--num-spec,--num-sp…") at
    # 80 columns; click's wraps the descriptions and never cuts an option
    rich_markup_mode=None,
)

EXIT_USAGE = 2
ENGINE_MODULES = ("torch", "transformers", "safetensors")  # the engine extra


class EngineExtraMissing(HybridKVError):
    """A command needs the engine extra (torch, transformers, safetensors)."""


def emit_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def say_notes(notes: list[str]) -> None:
    """Defaults the command chose for the user, on stderr (stdout stays JSON-clean)."""
    for note in notes:
        Console(stderr=True).print(f"note: {escape(note)}", highlight=False)


def run_guarded(as_json: bool, body: Callable[[], None]) -> None:
    """Run ``body``; turn every failure into exit status 2 with a readable message."""
    try:
        try:
            body()
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] not in ENGINE_MODULES:
                raise
            raise EngineExtraMissing(
                f"this command needs {err.name}, which is not installed: install the engine "
                "extra: pip install 'hybridkv[engine]'"
            ) from None
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
    num_spec: o.NumSpec = None,
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
        say_notes(args.notes)
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
        console = Console()
        table = Table(title=f"{len(presets)} presets", title_justify="left")
        if console.width >= WIDE_COLUMNS:
            for col in ("name", "family", "layer mix", "hf id"):
                table.add_column(col, no_wrap=col in ("name", "hf id"))
            for p in presets:
                table.add_row(p.name, p.family, short_mix(p.layer_mix), p.hf_id)
        else:  # stacked: the name and its Hugging Face id in one cell, never cut
            table.add_column("name / hf id", no_wrap=True)
            table.add_column("family: layer mix", overflow="fold")
            for p in presets:
                table.add_row(
                    f"{p.name}\n[dim]{p.hf_id}[/dim]", f"{p.family}: {short_mix(p.layer_mix)}"
                )
        console.print(table, LEGEND, highlight=False)
        return

    run_guarded(as_json, body)


WIDE_COLUMNS = 120  # below this, `hybridkv models` stacks name and hf id


def short_mix(layer_mix: str) -> str:
    """'12 full_attention, 36 state:gated_delta_net' -> '12 full, 36 gdn' (see LEGEND)."""
    parts = []
    for part in layer_mix.split(", "):
        count, _, kind = part.partition(" ")
        parts.append(f"{count} {short_kind(kind)}")
    return ", ".join(parts)


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_command(
    ctx: typer.Context,
    name: str = typer.Argument(help="a benchmark without .py, e.g. planner"),
) -> None:
    """Run one benchmark script (bench/NAME.py; installed with the package too)."""
    import runpy

    def body() -> None:
        script = find_benchmark(name)
        sys.argv = [str(script), *ctx.args]
        try:
            runpy.run_path(str(script), run_name="__main__")
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] in ENGINE_MODULES:
                raise
            raise FileNotFoundError(
                f"benchmark {name!r} needs the module {err.name!r}, which is not installed"
            ) from None

    run_guarded(False, body)


def benchmark_dirs() -> list[Path]:
    """Where benchmark scripts live: the source checkout's bench/ (editable install or
    a clone), then the copy `pip install .` puts under <prefix>/share/hybridkv/bench."""
    import site

    candidates = [
        Path(__file__).resolve().parents[2] / "bench",
        Path(sys.prefix) / "share" / "hybridkv" / "bench",
        Path(site.getuserbase()) / "share" / "hybridkv" / "bench",
    ]
    return [d for d in candidates if d.is_dir()]


def find_benchmark(name: str) -> Path:
    dirs = benchmark_dirs()
    for folder in dirs:
        script = folder / f"{name}.py"
        if script.is_file() and not name.startswith("_"):
            return script
    available = sorted({p.stem for d in dirs for p in d.glob("*.py") if not p.stem.startswith("_")})
    if not dirs:
        raise FileNotFoundError(
            "no benchmark scripts found: they ship in the source checkout's bench/ folder "
            "and are installed under <prefix>/share/hybridkv/bench by pip install; reinstall "
            "hybridkv, or run python bench/NAME.py from a clone"
        )
    raise FileNotFoundError(
        f"no benchmark {name!r}; available: {', '.join(available) or 'none'} "
        f"(in {', '.join(map(str, dirs))})"
    )


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

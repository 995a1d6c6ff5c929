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
from typer.core import TyperCommand, TyperGroup

from hybridkv.cli import options as o
from hybridkv.errors import HybridKVError
from hybridkv.plan.report import short_kind
from hybridkv.tables import Column, fit_table


class _CommandList(TyperGroup):
    """`hybridkv --help` lists each command with the whole first sentence of its help,
    wrapped: click's default cuts it at the column budget with "..." (at 45 characters
    when a command name is long), which left half a sentence per command."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=1 << 16)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    cls=_CommandList,
    add_completion=False,
    no_args_is_help=True,
    help="Plan, manage and prove KV-cache / recurrent-state memory for hybrid LLMs.",
    pretty_exceptions_enable=False,
    # plain click help: rich's help panels cut option names ("--num-spec,--num-sp…") at
    # 80 columns; click's wraps the descriptions and never cuts an option
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    """``--version``: the version and which cache-core build is loaded (see setup.py)."""
    if value:
        from hybridkv import __version__
        from hybridkv.cache import COMPILED

        core = "compiled (mypyc)" if COMPILED else "pure Python"
        typer.echo(
            f"hybridkv {__version__}, cache core: {core} (hybridkv.cache.COMPILED={COMPILED})"
        )
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    pass


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
    """List the built-in models: the presets and the demo checkpoints (name, family,
    layer mix, Hugging Face id, source). Each name works as MODEL in plan / simulate."""

    def body() -> None:
        rows = model_rows()
        if as_json:
            emit_json(rows)
            return
        console = Console()
        title = (
            f"{len(rows)} models ({len(rows) - len(DEMO_ROWS)} presets, "
            f"{len(DEMO_ROWS)} demo checkpoints)"
        )
        cells = [
            [r["name"], r["family"], short_mix(r["layer_mix"]), r["hf_id"], short_source(r)]
            for r in rows
        ]
        console.print(fit_table(title, MODEL_COLUMNS, cells, console.width), highlight=False)
        console.print(kinds_legend(rows), highlight=False)

    run_guarded(as_json, body)


# Names and Hugging Face ids are never wrapped; the layer mix and the source are, and
# below these widths a model is listed as a record of its own (`hybridkv.tables`).
MODEL_COLUMNS = [
    Column("name"),
    Column("family"),
    Column("layer mix", breaks=", ", min_width=18),
    Column("hf id"),
    Column("source", breaks=" ;/", min_width=36),
]
# The demo checkpoints `hybridkv demo` / `serve demo` run, listed beside the presets.
DEMO_ROWS = {"demo": "main", "demo-draft": "draft"}


def model_rows() -> list[dict[str, Any]]:
    """Every preset, then the demo checkpoints (source: their folder, which holds the
    config, weights and Hugging Face tokenizer files)."""
    from hybridkv.demo import DEMO_CHECKPOINTS
    from hybridkv.models import list_presets, load_model_spec
    from hybridkv.models.registry import TABLE

    rows: list[dict[str, Any]] = [
        {
            "name": p.name,
            "family": p.family,
            "model_type": p.model_type,
            "hf_id": p.hf_id,
            "layer_mix": p.layer_mix,
            "source": list(p.source),
        }
        for p in list_presets()
    ]
    for name in DEMO_ROWS:
        folder = DEMO_CHECKPOINTS[name]
        spec = load_model_spec(folder)
        rows.append(
            {
                "name": name,
                "family": TABLE[spec.model_type].family,
                "model_type": spec.model_type,
                "hf_id": "",
                "layer_mix": spec.layer_mix(),
                "source": [f"built-in demo checkpoint: {folder}"],
            }
        )
    return rows


def short_source(row: dict[str, Any]) -> str:
    """Each source's name without its path and notes ('huggingface/transformers: src/...
    @abc (...)' -> 'huggingface/transformers'); `--json` has them whole."""
    if row["name"] in DEMO_ROWS:
        return f"built in: {row['source'][0].rpartition(': ')[2]}"
    labels = []
    for source in row["source"]:
        label = source
        for cut in (": ", " @", " ("):
            label = label.split(cut)[0]
        if "not verified" in source.lower():
            label += " (unverified)"
        labels.append(label)
    return "; ".join(labels) or "-"


def kinds_legend(rows: list[dict[str, Any]]) -> str:
    """The abbreviations the layer-mix column uses, and only those."""
    names = {
        "full": "full attention",
        "swa": "sliding-window attention",
        "chunk": "chunked local attention",
        "mla": "multi-head latent attention",
        "gdn": "Gated DeltaNet",
        "mamba2": "Mamba2",
        "mamba1": "Mamba1",
        "sconv": "short conv",
        "kda": "Kimi delta attention",
        "light": "lightning attention",
    }
    used = {short_kind(part.partition(" ")[2]) for r in rows for part in r["layer_mix"].split(", ")}
    shown = [f"{k} = {v}" for k, v in names.items() if k in used and k != v.lower()]
    return "layer kinds: " + ", ".join(shown) + "; full sources: hybridkv models --json"


def short_mix(layer_mix: str) -> str:
    """'12 full_attention, 36 state:gated_delta_net' -> '12 full, 36 gdn'."""
    parts = []
    for part in layer_mix.split(", "):
        count, _, kind = part.partition(" ")
        parts.append(f"{count} {short_kind(kind)}")
    return ", ".join(parts)


class BenchCommand(TyperCommand):
    """`hybridkv bench --help` lists the benchmarks found, one line each; after a NAME,
    ``--help`` goes to that script (`hybridkv bench planner --help`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and {"--help", "-h"} & set(args[1:]):
            ctx.help_option_names = []  # the script's own help, not ours
        return list(super().parse_args(ctx, args))

    def format_epilog(self, ctx: Any, formatter: Any) -> None:  # typer's vendored click
        rows = benchmark_summaries()
        with formatter.section("Benchmarks (NAME; extra arguments go to the script)"):
            formatter.write_dl(rows or [("(none)", "no bench/ folder found")])
        super().format_epilog(ctx, formatter)


@app.command(
    "bench",
    cls=BenchCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def bench_command(
    ctx: typer.Context,
    name: str = typer.Argument(
        metavar="NAME", help="a benchmark without .py (listed below), e.g. planner"
    ),
) -> None:
    """Run one benchmark script (bench/NAME.py; installed with the package too). Its
    own options: hybridkv bench NAME --help."""
    import runpy

    from hybridkv.progress import progress_bar

    def body() -> None:
        script = find_benchmark(name)
        sys.argv = [str(script), *ctx.args]
        quiet = "--json" in ctx.args or "--help" in ctx.args or "-h" in ctx.args
        try:
            with progress_bar(f"bench {name}", None, quiet=quiet):
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
        Path(__file__).resolve().parents[3] / "bench",
        Path(sys.prefix) / "share" / "hybridkv" / "bench",
        Path(site.getuserbase()) / "share" / "hybridkv" / "bench",
    ]
    return [d for d in candidates if d.is_dir()]


def benchmark_summaries() -> list[tuple[str, str]]:
    """(name, the first line of its docstring's first paragraph) per benchmark script,
    read without running it."""
    import ast

    rows: dict[str, str] = {}
    for folder in benchmark_dirs():
        for script in sorted(folder.glob("*.py")):
            if script.stem.startswith("_") or script.stem in rows:
                continue
            try:
                doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
            except (OSError, SyntaxError, ValueError):
                doc = ""
            paragraph = " ".join(doc.split("\n\n")[0].split())
            rows[script.stem] = paragraph.split(". ")[0].rstrip(".") or "(no description)"
    return sorted(rows.items())


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
    for module in ("hybridkv.cli.sim", "hybridkv.cli.engine", "hybridkv.cli.serve"):
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

"""A newcomer's first five minutes without a wrong number (issue 41).

Plan tables keep every number whole at 60-120 columns and when piped; `--help` and
`hybridkv models` stay readable at 80-150 columns; every command shares one limit on K;
sizes are parsed strictly; trace-gen refuses an empty trace; block sizes off the kernels'
grid are refused with the reason.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import hybridkv.cli.sim  # noqa: F401  (registers simulate / trace-gen)
from hybridkv.cli.options import parse_bytes
from hybridkv.cli.root import _register_optional_commands, app, model_rows, short_source
from hybridkv.errors import PlanError
from hybridkv.models import load_model_spec
from hybridkv.plan import plan
from hybridkv.plan.report import _layer_span, _row_key, format_bytes, render
from hybridkv.plan.types import MAX_SPEC_TOKENS, CachePlan, GroupPlan, PlanOptions
from hybridkv.spec.dtypes import DType
from hybridkv.tables import wrap_at

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
_register_optional_commands()


def refused(args: list[str], *needles: str) -> str:
    result = runner.invoke(app, args)
    flat = " ".join(result.output.split())
    assert result.exit_code == 2, (args, result.exit_code, result.output)
    assert "internal error" not in flat and "Traceback" not in flat, flat
    for needle in needles:
        assert needle in flat, (needle, flat)
    return flat


# ------------------------------------------------------------- plan tables, any width

PLANS = {
    "readme pair": (
        "qwen3-coder-next-80b-a3b",
        "qwen3-4b",
        PlanOptions(
            spec_method="draft",
            num_spec_tokens=3,
            kv_dtype=DType.FP8_E4M3,
            memory_bytes=60 << 30,
            max_model_len=32768,
        ),
    ),
    "gpt-oss split": ("gpt-oss-120b", None, PlanOptions(layout="split")),
    "falcon vllm": ("falcon-h1-0.5b-instruct", None, PlanOptions(layout="vllm")),
    "kimi mla": ("kimi-linear-48b-a3b-instruct", None, PlanOptions()),
}


def as_read(output: str) -> str:
    """The output as a reader takes it in: a table's columns read top to bottom (the
    lines of a wrapped cell joined), other lines as they are, whitespace collapsed, and
    a line broken after a comma closed up again."""
    parts: list[str] = []
    columns: list[list[str]] = []
    for line in [*output.splitlines(), ""]:
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            columns = columns or [[] for _ in cells]
            for column, cell in zip(columns, cells, strict=True):
                column.append(cell)
            continue
        parts += [" ".join(column) for column in columns]
        columns = []
        parts.append(line.strip("┃ "))
    return re.sub(r",\s+", ",", " ".join(" ".join(parts).split()))


def plan_values(p: CachePlan) -> list[str]:
    """Every number the tables show, as the tables write it."""
    values = []
    for g in p.groups:
        values += [str(g.block_size), format_bytes(g.page_bytes)]
        if g.padded_page_bytes != g.page_bytes:
            values.append(f"({format_bytes(g.padded_page_bytes)})")
    for pool in p.pools:
        values += [str(pool.num_pages), format_bytes(pool.page_bytes)]
        values.append(format_bytes(pool.total_bytes))
    for alt in (p, *p.alternatives) if p.alternatives else ():  # the comparison table
        s = alt.summary()
        values += [
            f"{s['max_concurrency']} ({s['max_concurrency_float']})",
            f"{alt.waste_fraction:.2%}",
            ",".join(map(str, s["attention_block_sizes"])),
            str(s["hit_granularity_tokens"]),
        ]
    return values


def assert_whole(text: str, values: list[str]) -> None:
    for value in values:
        found = re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", text)
        assert found, f"{value!r} is not shown whole in: {text}"


@pytest.fixture(scope="module", params=list(PLANS))
def a_plan(request: pytest.FixtureRequest) -> CachePlan:
    main, draft, options = PLANS[request.param]
    return plan(load_model_spec(main), load_model_spec(draft) if draft else None, options)


@pytest.mark.parametrize("width", [60, 80, 100, 120])
def test_plan_tables_show_every_number_whole_at_any_width(a_plan: CachePlan, width: int) -> None:
    """rich shrank no-wrap columns below their numbers (a block of 1680 shown as "16"
    below ~140 columns, empty columns at 80); every value is now whole, and so is each
    group's list of layers."""
    out = io.StringIO()
    render(a_plan, Console(file=out, width=width, color_system=None))
    text = out.getvalue()
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines()), text
    read = as_read(text)
    assert_whole(read, plan_values(a_plan))
    for run in runs(a_plan):
        span = _layer_span([ref.name for g in run for ref in g.layers])
        assert span in read, span


def runs(p: CachePlan) -> list[list[GroupPlan]]:
    """The groups table's rows: runs of consecutive groups that differ only in layers."""
    out: list[list[GroupPlan]] = []
    for g in p.groups:
        if out and _row_key(out[-1][-1]) == _row_key(g):
            out[-1].append(g)
        else:
            out.append([g])
    return out


def test_plan_piped_output_shows_every_number_whole() -> None:
    """Piped (no terminal, no COLUMNS), rich falls back to 80 columns: the same rule."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    main, draft, options = PLANS["readme pair"]
    args = [
        "plan", main, "--draft", str(draft), "--spec-method", "draft", "--num-spec", "3",
        "--kv-dtype", "fp8_e4m3", "--memory", "60GiB", "--max-model-len", "32768",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    p = plan(load_model_spec(main), load_model_spec(str(draft)), options)
    assert_whole(as_read(proc.stdout), plan_values(p))
    assert "1680" in proc.stdout and "19 (19.492)" in proc.stdout


def test_wrap_at_breaks_only_after_the_break_characters() -> None:
    assert wrap_at("main.0-2,4-6,8-10 draft.0", 10, ", ") == ["main.0-2,", "4-6,8-10", "draft.0"]
    assert wrap_at("1680", 2, ", ") == ["1680"]  # never cut: too long stays whole
    assert wrap_at("a b\nc", 80, " ") == ["a b", "c"]


# ----------------------------------------------------------- help and the models list


@pytest.mark.parametrize("width", [80, 120, 150])
def test_help_lists_each_commands_first_sentence_whole(width: int) -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": str(width)}, terminal_width=width)
    flat = " ".join(result.output.split())
    assert "..." not in flat.replace("[ARGS]...", ""), result.output
    for name in ("plan", "models", "bench", "simulate", "generate", "demo", "serve"):
        command = app.registered_commands
        help_text = next(c for c in command if c.name == name).callback.__doc__ or ""
        first = " ".join(help_text.split("\n\n")[0].split()).split(". ")[0].rstrip(".")
        assert first in flat, (name, first)


@pytest.mark.parametrize("width", [80, 120, 150])
def test_models_list_is_readable_at_80_to_150_columns(width: int) -> None:
    """The source column was squeezed to ~10 characters at 120-150 columns (437 lines
    at 120); now each source reads whole, in 3-4 lines a model."""
    result = runner.invoke(app, ["models"], env={"COLUMNS": str(width)}, terminal_width=width)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    rows = model_rows()
    assert len(lines) <= (4 if width < 120 else 3.5) * len(rows) + 8, len(lines)
    read = as_read(result.output)
    for row in rows:
        assert row["name"] in read and (row["hf_id"] in read)
        source = re.sub(r",\s+", ",", " ".join(short_source(row).split()))
        assert source in read.replace("/ ", "/"), row["name"]


# ------------------------------------------------------------------- one K for all


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "qwen3-4b", "--spec-method", "ngram", "--num-spec", "{k}"],
        ["trace-gen", "chat", "{out}", "--max-drafts", "{k}"],
        ["demo", "--num-spec", "{k}"],
        ["generate", "demo", "--draft", "demo-draft", "--num-spec", "{k}", "--prompt", "x"],
        ["serve", "demo", "--draft", "demo-draft", "--num-spec", "{k}", "--port", "0"],
    ],
    ids=lambda a: a[0],
)
def test_every_command_refuses_k_above_the_one_limit(args: list[str], tmp_path: Path) -> None:
    """`plan` refused K=300, `generate` / `serve` / `demo` took it (or blamed the
    memory); one limit (`MAX_SPEC_TOKENS`) and one check now answer for all."""
    if args[0] in ("demo", "generate", "serve"):
        pytest.importorskip("torch")
    if args[0] == "serve":
        pytest.importorskip("fastapi")
    k = str(MAX_SPEC_TOKENS + 1)
    filled = [a.format(k=k, out=tmp_path / "t.jsonl") for a in args]
    refused(filled, f"={k}", f"K must be an integer from 0 to {MAX_SPEC_TOKENS}")
    assert not (tmp_path / "t.jsonl").exists()


def test_k_at_the_limit_plans() -> None:
    result = runner.invoke(
        app, ["plan", "qwen3-4b", "--spec-method", "ngram", "--num-spec", str(MAX_SPEC_TOKENS)]
    )
    assert result.exit_code == 0, result.output


def test_the_python_api_has_the_same_k_limit() -> None:
    with pytest.raises(PlanError, match=f"0 to {MAX_SPEC_TOKENS}"):
        plan(
            load_model_spec("qwen3-4b"),
            None,
            PlanOptions(spec_method="ngram", num_spec_tokens=MAX_SPEC_TOKENS + 1),
        )


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 << 30), ("8G", 8 << 30), ("8g", 8 << 30), ("8GB", 8 * 10**9), ("8kB", 8000)],
)
def test_sizes_in_the_documented_forms(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("8Gb", "a lower-case b is a bit"),
        ("8gb", "a lower-case b is a bit"),
        ("8gib", "a lower-case b is a bit"),
        ("8GIB", "unknown unit"),
        ("8 gigs", "unknown unit"),
        ("8.5.1G", "not a size"),
    ],
)
def test_ambiguous_or_malformed_sizes_are_refused_naming_the_forms(text: str, why: str) -> None:
    """ "8Gb" was read as 8 GB without a word; a lower-case b is a bit, so it is refused
    like any other unit we would have to guess, with the forms that are accepted."""
    with pytest.raises(PlanError, match=why) as err:
        parse_bytes(text)
    assert "80GiB or 80G (binary" in str(err.value) and "80GB (decimal" in str(err.value)


def test_memory_8gb_bits_is_refused_by_the_cli() -> None:
    refused(["plan", "qwen3-4b", "--memory", "8Gb"], "--memory='8Gb'", "bit", "80GiB")


# --------------------------------------------------------- empty traces, block sizes


def test_trace_gen_refuses_zero_requests(tmp_path: Path) -> None:
    """It wrote a trace that `simulate` then refused as empty."""
    out = tmp_path / "t.jsonl"
    refused(["trace-gen", "chat", str(out), "--num-requests", "0"], "num_requests=0", ">= 1")
    assert not out.exists()


@pytest.mark.parametrize("layout", ["auto", "shared", "split", "vllm"])
def test_block_sizes_off_the_kernels_grid_are_refused_with_the_reason(layout: str) -> None:
    flat = refused(
        ["plan", "qwen3-4b", "--block-size", "7", "--layout", layout],
        "block_size=7",
        "multiples of 16",
        "use 16",
    )
    assert "block_size=40" not in flat
    refused(["plan", "qwen3-4b", "--block-size", "40"], "use 32 or 48")
    ok = runner.invoke(app, ["plan", "qwen3-4b", "--block-size", "32", "--layout", "split"])
    assert ok.exit_code == 0, ok.output


# -------------------------------------------------------------------------- lm-eval


def test_the_documented_lm_eval_task_runs_offline_from_the_repository() -> None:
    """docs/demo.md's lm-eval command names a task folder whose data ships beside it
    (lm-eval itself is not a dependency: the command was run by hand, see the doc)."""
    doc = (REPO / "docs" / "demo.md").read_text()
    section = doc.split("## lm-eval against")[1]
    (folder,) = re.findall(r"--include_path (\S+)", section)
    (task,) = re.findall(r"--tasks (\S+)", section)
    spec = (REPO / folder / f"{task}.yaml").read_text()
    assert f"task: {task}" in spec
    (data,) = re.findall(r"data_files: (\S+)", spec)
    lines = [json.loads(line) for line in (REPO / data).read_text().splitlines()]
    assert len(lines) == 4
    assert all(0 <= q["answer"] < len(q["choices"]) and q["context"] for q in lines)
    assert "'lm-eval[api]==0.4.13' transformers" in section

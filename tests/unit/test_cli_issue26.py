"""CLI for a newcomer: `bench --help` lists the benchmarks, `models` shows what its help
says (with a source column and the demo checkpoints), layer lists show gaps, progress
bars stay out of logs and `--json`, and `simulate --plot` without matplotlib says what
to install before simulating."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hybridkv.cli.sim  # noqa: F401  (registers simulate / trace-gen)
from hybridkv.cli import app
from hybridkv.plan.report import _layer_span
from hybridkv.progress import bar_enabled, progress_bar

REPO = Path(__file__).resolve().parents[2]


def invoke(args: list[str], columns: int = 80) -> object:
    return CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})


def test_bench_help_lists_every_benchmark_with_its_docstring() -> None:
    result = invoke(["bench", "--help"], columns=200)
    assert result.exit_code == 0, result.output
    scripts = sorted(p for p in (REPO / "bench").glob("*.py") if not p.stem.startswith("_"))
    assert len(scripts) >= 5
    lines = result.output.splitlines()
    for script in scripts:
        doc = ast.get_docstring(ast.parse(script.read_text())) or "(no description)"
        first_words = " ".join(doc.split()[:4])
        row = next((line for line in lines if line.strip().startswith(script.stem + " ")), None)
        assert row is not None, f"{script.stem} missing from bench --help"
        assert first_words in row, (first_words, row)
    assert not any(line.strip().startswith("_") for line in lines)  # helpers are not listed


def test_help_after_a_benchmark_name_is_the_scripts_own() -> None:
    result = invoke(["bench", "planner", "--help"])
    assert result.exit_code == 0, result.output
    assert "usage: planner.py" in result.output and "Benchmarks (NAME" not in result.output


def test_models_shows_source_and_the_demo_checkpoints_without_the_plan_legend() -> None:
    help_text = invoke(["models", "--help"]).output
    assert "source" in help_text
    for columns in (80, 160):
        out = invoke(["models"], columns=columns).output
        assert "source" in out and "demo-draft" in out and "built in:" in out
        assert "page: raw" not in out and "dtypes" not in out  # the plan table's legend
        assert "gdn = Gated DeltaNet" in out
    rows = json.loads(invoke(["models", "--json"]).stdout)
    names = [r["name"] for r in rows]
    assert names[-2:] == ["demo", "demo-draft"] and len(names) == len(set(names))
    assert all(r["source"] for r in rows)
    demo = rows[-2]
    assert demo["layer_mix"] == "2 full_attention, 4 state:gated_delta_net"
    assert Path(demo["source"][0].rpartition(": ")[2], "tokenizer.json").is_file()


def test_demo_names_plan_like_presets() -> None:
    result = invoke(
        ["plan", "demo", "--draft", "demo-draft", "--num-spec", "4", "--memory", "32MiB"],
        columns=120,
    )
    assert result.exit_code == 0, result.output
    assert "main.0-1,3-4" in result.output and "main.2,5" in result.output
    assert "main.0..4" not in result.output


@pytest.mark.parametrize(
    ("names", "shown"),
    [
        (["main.0", "main.1", "main.3", "main.4"], "main.0-1,3-4"),
        (["main.2", "main.5"], "main.2,5"),
        (["main.0", "main.1", "main.2", "draft.0", "draft.1"], "main.0-2 draft.0-1"),
        ([f"main.{i}" for i in (0, 1, 2, 4, 5, 6, 9)], "main.0-2,4-6,9"),
        (["embed", "main.3"], "embed main.3"),
        (["main.7"], "main.7"),
    ],
)
def test_layer_lists_show_gaps(names: list[str], shown: str) -> None:
    assert _layer_span(names) == shown


def test_progress_bars_stay_out_of_logs_and_json(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not bar_enabled()  # pytest captures stdout: not a terminal
    with progress_bar("work", 3) as advance:
        advance(3)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert bar_enabled() and not bar_enabled(quiet=True)
    seen = []
    with progress_bar("work", 2) as advance:  # a real bar: advance takes steps
        advance(1)
        advance(1)
        seen.append("ok")
    assert seen == ["ok"]
    # a bar inside a bar (a benchmark's grid under `hybridkv bench`) is a row of the outer
    # one: rich refuses a second live display
    with progress_bar("bench", None) as outer, progress_bar("grid", 4) as inner:
        inner(4)
        outer(1)


def test_trace_gen_and_simulate_print_no_bar_when_piped(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    result = invoke(["trace-gen", "chat", str(trace), "--num-requests", "12"])
    assert result.exit_code == 0 and result.output.startswith("wrote 12 requests")
    result = invoke(
        [
            "simulate",
            str(trace),
            "qwen3.5-9b",
            "--memory",
            "16GiB",
            "--max-model-len",
            "32768",
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_finished"] == 12  # nothing but JSON on stdout


def test_simulate_plot_without_matplotlib_names_the_extra_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "t.jsonl"
    assert invoke(["trace-gen", "chat", str(trace), "--num-requests", "4"]).exit_code == 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    ran = []
    monkeypatch.setattr("hybridkv.sim.simulator.simulate", lambda *a, **k: ran.append(1))
    result = invoke(
        [
            "simulate",
            str(trace),
            "qwen3.5-9b",
            "--memory",
            "16GiB",
            "--max-model-len",
            "32768",
            "--plot",
            str(tmp_path / "u.png"),
        ]
    )
    assert result.exit_code == 2
    assert "--plot needs matplotlib" in result.output and "hybridkv[plot]" in result.output
    assert not ran and not (tmp_path / "u.png").exists()


def test_plot_extra_in_pyproject_brings_matplotlib() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("matplotlib") for dep in extras["plot"])
    assert "hybridkv[plot]" in extras["bench"]


def test_demo_report_marks_where_each_completion_starts(capsys: pytest.CaptureFixture) -> None:
    from hybridkv.cli.demo import DemoOptions, print_report, run_demo

    llm, report = run_demo(DemoOptions(num_requests=2, max_new_tokens=8, threads=1), False)
    print_report(llm, report)
    out = capsys.readouterr().out
    assert out.count(">>> completion (8 tokens, finish: length):") == 2
    assert out.count("prompt (last 60 of") == 2
    parts = out.split(">>> completion")
    for i, o in enumerate(report["outputs"]):  # each completion follows its own marker
        assert o["text"].splitlines()[0] in parts[i + 1]
    assert "main.0-1,3-4" in out

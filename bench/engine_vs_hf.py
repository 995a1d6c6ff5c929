"""Engine against transformers: `LLM.generate` vs `generate` on the same model and prompts.

Question: how fast is the reference engine's continuous-batching loop against
transformers' own batched `generate`, and does it emit the same tokens? Model: a
random-weight Qwen3.5-style hybrid built with transformers itself (hidden 480, 8 layers:
6 Gated DeltaNet + 2 gated full attention, float32), greedy, 256-token prompts, 64 new
tokens, torch threads = 2 (``--threads``). Cases: batch 1, 8, 32 of distinct prompts, and
32 prompts sharing a 224-token prefix (prefix caching on in the engine; transformers has
none). Both sides get the same token ids; prompts have equal length, so transformers
needs no padding. Runs alternate (engine, transformers, engine, ...); each engine run
builds a fresh `LLM` (untimed) so no run hits a previous run's prefix cache.

    python bench/engine_vs_hf.py [--reps 3] [--cases 1,8,32,shared32] [--threads 2]
                                 [--device cpu|cuda]
    hybridkv bench engine_vs_hf -- --reps 3

``--device cuda`` runs both sides on the GPU (weights, caches, inputs), timed with
``torch.cuda.synchronize()`` around each run; `scripts/gpu_check.sh` runs it. There the
CPU-seconds ratio only measures the host side.

Printed per case: median wall seconds and range per side, the ratio (transformers time /
engine time: > 1 means the engine is faster), the same ratio of process CPU seconds
(steadier than wall time on a shared machine: time spent waiting for a core is not
counted), output tokens per second, engine steps and prefix-hit tokens (work counters),
and whether the tokens match exactly.

On a machine where another process holds a core, two-thread runs stall in OpenMP's
spin-waiting barrier (each parallel op then waits a scheduler time slice, on both
sides, at random); ``OMP_WAIT_POLICY=PASSIVE python bench/engine_vs_hf.py ...`` (set
before torch loads, so for both sides alike) keeps such runs comparable
(docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv.engine import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The same prompts as bench/engine_vs_vllm.py (one definition of the cases)
from engine_vs_vllm import (
    NEW_TOKENS,
    PROMPT_TOKENS,
    VOCAB,
    make_prompts,
)

T = TypeVar("T")


def build_model(folder: Path, seed: int = 0) -> torch.nn.Module:
    """The random-weight hybrid, saved to ``folder`` for the engine; returned for HF."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=480,
        intermediate_size=1280,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return model


def run_hf(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [row[ids.shape[1] :].tolist() for row in out]


@dataclass
class EngineRun:
    tokens: list[list[int]]
    seconds: float
    cpu_seconds: float
    steps: int
    hit_tokens: int


def run_engine(
    folder: Path, prompts: Sequence[Sequence[int]], max_batched: int, device: str = "cpu"
) -> EngineRun:
    llm = LLM(
        folder,
        memory_bytes=1 << 30,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=max_batched,
        max_model_len=PROMPT_TOKENS + NEW_TOKENS,
        device=device,
    )
    results, seconds, cpu_seconds = timed(
        lambda: llm.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True), device
    )
    stats = llm.stats()
    return EngineRun(
        [r.token_ids for r in results],
        seconds,
        cpu_seconds,
        stats.num_steps,
        max(stats.prefix_hit_tokens.values(), default=0),
    )


def timed(fn: Callable[[], T], device: str = "cpu") -> tuple[T, float, float]:
    """``fn()``, its wall seconds and its process CPU seconds (all threads); on CUDA
    the device is synchronised before the clocks start and before they stop."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start, cpu_start = time.perf_counter(), time.process_time()
    out = fn()
    sync()
    return out, time.perf_counter() - start, time.process_time() - cpu_start


def spread(xs: Sequence[float]) -> str:
    return escape(f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default="1,8,32,shared32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=PROMPT_TOKENS * 32,
        help="engine token budget per step (default: every prompt of batch 32 in one step)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=150)
    table = Table(
        title=f"LLM.generate vs transformers generate: {PROMPT_TOKENS}-token prompts, "
        f"{NEW_TOKENS} new tokens, greedy, fp32, {args.device}, {args.threads} threads, "
        f"median \\[min-max] of {args.reps} alternating runs"
    )
    for col in (
        "case",
        "engine s",
        "transformers s",
        "ratio (hf/engine)",
        "cpu ratio",
        "engine tok/s",
        "steps",
        "prefix hit tok",
        "token-exact",
    ):
        table.add_column(col)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        hf = build_model(folder).to(args.device)
        for case in args.cases.split(","):
            prompts = make_prompts(case)
            engine_s: list[float] = []
            hf_s: list[float] = []
            hf_cpu: list[float] = []
            runs: list[EngineRun] = []
            hf_tokens: list[list[int]] = []
            for _ in range(args.reps):
                run = run_engine(folder, prompts, args.max_batched_tokens, args.device)
                runs.append(run)
                engine_s.append(run.seconds)
                hf_tokens, seconds, cpu = timed(lambda p=prompts: run_hf(hf, p), args.device)  # type: ignore[misc]
                hf_s.append(seconds)
                hf_cpu.append(cpu)
            same = sum(r == h for r, h in zip(runs[-1].tokens, hf_tokens, strict=True))
            exact = "yes" if same == len(prompts) else f"NO ({same}/{len(prompts)} rows)"
            ratio = statistics.median(hf_s) / statistics.median(engine_s)
            engine_cpu = [r.cpu_seconds for r in runs]
            cpu_ratio = statistics.median(hf_cpu) / statistics.median(engine_cpu)
            table.add_row(
                case,
                spread(engine_s),
                spread(hf_s),
                f"{ratio:.2f}x",
                f"{cpu_ratio:.2f}x",
                f"{len(prompts) * NEW_TOKENS / statistics.median(engine_s):.0f}",
                str(runs[-1].steps),
                str(runs[-1].hit_tokens),
                exact,
            )
            console.print(
                f"{case}: engine {spread(engine_s)} s, transformers {spread(hf_s)} s, "
                f"{ratio:.2f}x; cpu engine {spread(engine_cpu)} s, transformers "
                f"{spread(hf_cpu)} s, {cpu_ratio:.2f}x; exact {exact}"
            )
    console.print(table)


if __name__ == "__main__":
    main()

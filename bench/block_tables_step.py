"""Block-table upkeep per decode step at batch 32: what the engine spends keeping the
device block tables in line with the cache manager, fed by deltas against diffed rows.

Question: how much does a decode step pay for block tables now that they are fed the
scheduler's per-step deltas (`DeviceBlockTables.apply_step`, then one gather per group),
against the previous way (every pass: copy each scheduled request's row from the
manager, diff it against a host copy, write what changed, gather)? Setup:
`bench/engine_vs_hf.py`'s random-weight Qwen3.5-style hybrid (hidden 480, 8 layers: 6
Gated DeltaNet + 2 full attention, float32), 32 distinct 256-token prompts, 64 new
tokens, greedy, torch threads = 2. Both ways run in the same passes of the same engine
(paired): the engine runs on the delta-fed tables; before each `build_batch`, the old
row-diffing update runs on a second set of tables (`PersistentBlockTable.apply`, still
there as the oracle) over the same requests, and is timed apart. Only steps where all 32
requests decode count.

    PYTHONPATH=src python bench/block_tables_step.py --reps 3

Printed: per run, the median microseconds per decode step of each way (and of the whole
`build_batch`: tables + state slots + batch tensors); then median and range over runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_vs_hf import NEW_TOKENS, PROMPT_TOKENS, build_model, make_prompts
from hybridkv.engine import LLM
from hybridkv.engine.forward import block_tables as bt
from hybridkv.engine.forward.runner import ModelRunner


class Timer:
    """Wall time of the wrapped calls, summed per engine step."""

    def __init__(self) -> None:
        self.step_ns = 0
        self.steps: list[int] = []

    def wrap(self, owner: Any, name: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.step_ns += time.perf_counter_ns() - start

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(self.step_ns)
        self.step_ns = 0


def run(folder: Path, prompts: list[list[int]]) -> dict[str, float]:
    llm = LLM(
        folder,
        memory_bytes=1 << 30,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=8192,
        max_model_len=PROMPT_TOKENS + NEW_TOKENS,
    )
    batch, deltas, diffed = Timer(), Timer(), Timer()
    old_tables = {
        g.group_id: bt.PersistentBlockTable(g.block_size, llm.device)
        for g in llm.runner.attention_groups
    }
    manager = llm.manager

    def rows_diffed(steps: Any) -> None:
        """The update `ModelRunner.build_batch` ran before deltas, on its own tables."""
        start = time.perf_counter_ns()
        for group_id, persistent in old_tables.items():
            rows = [
                persistent.apply(s.req_id, manager.block_table(s.req_id, group_id), live)
                for s in steps
            ]
            widths = [len(persistent.host[s.req_id]) for s in steps]
            persistent.table(rows, widths)
        diffed.step_ns += time.perf_counter_ns() - start

    live = manager.has_request
    original_build = ModelRunner.build_batch

    def build_batch(self: ModelRunner, steps: Any) -> Any:
        rows_diffed(steps)
        start = time.perf_counter_ns()
        try:
            return original_build(self, steps)
        finally:
            batch.step_ns += time.perf_counter_ns() - start

    ModelRunner.build_batch = build_batch  # type: ignore[method-assign]
    undo = [lambda: setattr(ModelRunner, "build_batch", original_build)]
    undo += [deltas.wrap(bt.DeviceBlockTables, "apply_step")]
    undo += [deltas.wrap(bt.DeviceBlockTables, "table")]
    decode_steps = 0

    def hook(output: Any, report: Any) -> None:
        nonlocal decode_steps
        keep = len(output.chunks) == len(prompts) and all(c.decode for c in output.chunks)
        decode_steps += keep
        for timer in (batch, deltas, diffed):
            timer.end_step(keep)

    llm.stepper.hooks.append(hook)
    try:
        llm.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    finally:
        for restore in reversed(undo):
            restore()
    return {
        "decode_steps": decode_steps,
        "deltas_us": statistics.median(deltas.steps) / 1e3,
        "rows_diffed_us": statistics.median(diffed.steps) / 1e3,
        "build_batch_us": statistics.median(batch.steps) / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder)
        prompts = make_prompts(str(args.batch))
        runs = []
        for rep in range(args.reps):
            runs.append(run(folder, prompts))
            print(f"run {rep}: {runs[-1]}", flush=True)
    print(f"batch {args.batch}, {runs[0]['decode_steps']} decode steps per run")
    for key in ("deltas_us", "rows_diffed_us", "build_batch_us"):
        values = [r[key] for r in runs]
        print(
            f"  {key}: median {statistics.median(values):.1f} "
            f"[{min(values):.1f}-{max(values):.1f}] us per decode step"
        )


if __name__ == "__main__":
    main()

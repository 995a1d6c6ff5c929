"""`hybridkv simulate` and `hybridkv trace-gen` (registered on `hybridkv.cli.app`).

Usage::

    hybridkv trace-gen suffix code.jsonl --num-requests 200 --seed 0 --max-drafts 16
    hybridkv simulate code.jsonl qwen3.5-0.8b --spec-method suffix --num-spec 16 \\
        --memory 8GiB --check-every 100 [--plot usage.png] [--json]

``trace-gen KIND OUT.jsonl``: KIND is one of chat | agentic | suffix | documents
(`hybridkv.sim.workloads`); ``--prefix-len LO:HI``, ``--suffix-len LO:HI``,
``--output-len LO:HI``, ``--num-prefixes``, ``--max-turns`` and ``--rate`` override
the kind's defaults. ``simulate TRACE MODEL`` takes every `hybridkv plan` option (the
scheduler's ``max_num_seqs`` / ``max_num_batched_tokens`` / K come from them) plus
``--check-every N``, ``--batched/--no-batched``, ``--max-steps`` and ``--plot PNG``
(needs matplotlib). JSON keys: see `SimResult.to_dict` (num_requests, num_finished,
prompt_tokens, prefix_hit_tokens, prefix_hit_rate, preemptions, peak_usage, steps,
manager_us_per_step, state_checkpoints_stored / _used, leaked_blocks, ...).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli import options as o
from hybridkv.cli.root import app, emit_json, run_guarded, say_notes
from hybridkv.errors import PlanError, TraceError
from hybridkv.plan.types import CachePlan
from hybridkv.progress import progress_bar
from hybridkv.sim.trace import TraceRequest

# The simulator builds one Python object per block; a plan with more pages than this
# (e.g. --memory 1PiB) would exhaust host memory before the first step.
MAX_SIMULATED_PAGES = 20_000_000

Range = Annotated[str | None, typer.Option(help="token range LO:HI")]


def _range(text: str | None, what: str) -> tuple[int, int] | None:
    if text is None:
        return None
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high if sep else low))
    except ValueError:
        raise ValueError(f"{what}={text!r} is not a token range; write e.g. 512:4096") from None
    return bounds


@app.command("trace-gen")
def trace_gen_command(
    kind: Annotated[str, typer.Argument(help="chat | agentic | suffix | documents")],
    out: Annotated[str, typer.Argument(help="output JSONL path")],
    num_requests: Annotated[int, typer.Option("--num-requests")] = 100,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    max_drafts: Annotated[int, typer.Option("--max-drafts", help="K: 0 = no spec")] = 0,
    rate: Annotated[float | None, typer.Option("--rate", help="arrivals per second")] = None,
    prefix_len: Range = None,
    suffix_len: Range = None,
    output_len: Range = None,
    num_prefixes: Annotated[int | None, typer.Option("--num-prefixes")] = None,
    max_turns: Annotated[int | None, typer.Option("--max-turns")] = None,
    as_json: o.Json = False,
) -> None:
    """Generate a seeded workload trace (JSONL, one request per line)."""

    def body() -> None:
        from hybridkv.sim.trace import write_trace
        from hybridkv.sim.workloads import generate_workload, workload_options

        opts = workload_options(
            kind,
            num_requests=num_requests,
            seed=seed,
            max_drafts=max_drafts,
            rate_per_s=rate,
            prefix_len=_range(prefix_len, "--prefix-len"),
            suffix_len=_range(suffix_len, "--suffix-len"),
            output_len=_range(output_len, "--output-len"),
            num_prefixes=num_prefixes,
            max_turns=max_turns,
        )
        with progress_bar(f"trace-gen {kind}", None, quiet=as_json):
            requests = generate_workload(kind, opts)
            count = write_trace(out, requests)
        summary = {
            "kind": kind,
            "path": out,
            "num_requests": count,
            "prompt_tokens": sum(len(r.prompt) for r in requests),
            "output_tokens": sum(len(r.output) for r in requests),
        }
        if as_json:
            emit_json(summary)
        else:
            Console().print(
                f"wrote {count} requests ({summary['prompt_tokens']} prompt, "
                f"{summary['output_tokens']} output tokens) to {out}"
            )

    run_guarded(as_json, body)


def _render(result: dict[str, object]) -> None:
    table = Table(title="simulation")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key == "cache_stats":
            continue
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)


def _need_matplotlib() -> None:
    """Refuse ``--plot`` before the simulation runs when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install 'hybridkv[plot]' "
            "(or pip install matplotlib), or drop --plot"
        ) from None


def _plot(result: object, path: str) -> None:
    _need_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result.usage_samples  # type: ignore[attr-defined]
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot([t for t, _ in samples], [u for _, u in samples])
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("cache usage")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def check_lengths(requests: list[TraceRequest], max_model_len: int) -> None:
    """Refuse a trace whose requests need more positions than the plan's max_model_len
    (a real engine would reject them at admission; replaying them would overstate hits
    and capacity)."""
    too_long = [r for r in requests if len(r.prompt) + len(r.output) > max_model_len]
    if too_long:
        first = too_long[0]
        raise TraceError(
            f"{len(too_long)} request(s) exceed max_model_len={max_model_len}: e.g. "
            f"{first.id!r} has {len(first.prompt)} prompt + {len(first.output)} output "
            f"tokens = {len(first.prompt) + len(first.output)}; raise --max-model-len or "
            "shorten the trace"
        )


def check_simulated_pages(cache_plan: CachePlan) -> None:
    pages = sum(p.num_pages for p in cache_plan.pools)
    if pages > MAX_SIMULATED_PAGES:
        raise PlanError(
            f"the plan has {pages} pages; the simulator holds at most {MAX_SIMULATED_PAGES} "
            "(one object each): lower --memory or raise --block-size"
        )


_SIM_KEYS = frozenset(
    {
        "trace",
        "check_every",
        "batched",
        "max_steps",
        "plot",
        "as_json",
        "eviction",
        "checkpoint_rule",
    }
)


@app.command("simulate")
def simulate_command(
    trace: Annotated[str, typer.Argument(help="JSONL trace (see hybridkv trace-gen)")],
    model: o.Model,
    draft: o.Draft = None,
    spec_method: o.SpecMethod = None,
    num_spec: o.NumSpec = None,
    speculative_config: o.SpecConfig = None,
    kv_dtype: o.KvDtype = "auto",
    conv_dtype: o.ConvDtype = "auto",
    ssm_dtype: o.SsmDtype = "auto",
    memory: o.Memory = None,
    gpu_memory: o.GpuMemory = None,
    gpu_memory_utilization: o.GpuUtil = 0.9,
    tp: o.Tp = 1,
    max_model_len: o.MaxLen = None,
    max_num_seqs: o.MaxSeqs = 256,
    max_num_batched_tokens: o.MaxBatched = 8192,
    prefix_caching: o.PrefixCaching = True,
    state_mode: o.StateMode = None,
    layout: o.Layout = "auto",
    block_size: o.BlockSize = None,
    target_len: o.TargetLen = None,
    typical_len: o.TypicalLen = None,
    check_every: Annotated[
        int, typer.Option("--check-every", help="check_invariants() every N steps (0: at the end)")
    ] = 0,
    batched: Annotated[
        bool, typer.Option("--batched/--no-batched", help="allocate_batch / commit_batch")
    ] = True,
    max_steps: Annotated[int | None, typer.Option("--max-steps")] = None,
    plot: Annotated[str | None, typer.Option("--plot", help="usage plot PNG")] = None,
    eviction: Annotated[
        str | None, typer.Option("--eviction", help="eviction policy: lru | chain")
    ] = None,
    checkpoint_rule: Annotated[
        list[str] | None,
        typer.Option(
            "--checkpoint-rule",
            help="extra checkpoint rules: junction, turn_end (repeatable; default: both; "
            "'none': off)",
        ),
    ] = None,
    as_json: o.Json = False,
) -> None:
    """Replay TRACE through a scheduler model and the real CacheManager under MODEL's plan."""
    args = o.PlanArgs(**{k: v for k, v in locals().items() if k not in _SIM_KEYS})

    def body() -> None:
        from hybridkv.plan import plan
        from hybridkv.sim.simulator import simulate
        from hybridkv.sim.trace import read_trace

        if plot:
            _need_matplotlib()
        requests = read_trace(trace)
        if not requests:
            raise TraceError(f"trace {trace} holds no requests (every line is blank)")
        main_spec, draft_spec, options = args.resolve()
        say_notes(args.notes)
        cache_plan = plan(main_spec, draft_spec, options)
        check_lengths(requests, cache_plan.capacity.max_model_len)
        check_simulated_pages(cache_plan)
        with progress_bar("simulate (requests finished)", len(requests), quiet=as_json) as done:
            result = simulate(
                requests,
                cache_plan,
                check_every=check_every,
                batched=batched,
                max_steps=max_steps,
                eviction_policy=eviction,
                checkpoint_rules=None
                if checkpoint_rule is None
                else tuple(r for r in checkpoint_rule if r != "none"),
                on_step=lambda _, report: done(len(report.finished)),
            )
        if plot:
            _plot(result, plot)
        payload = result.to_dict()
        if as_json:
            emit_json(payload)
        else:
            _render(payload)

    run_guarded(as_json, body)

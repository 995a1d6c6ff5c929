"""Human-readable rendering of a `CachePlan`: tables that fit the console without
cutting a number (`hybridkv.tables`)."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType

from hybridkv.plan.types import CachePlan, GroupPlan
from hybridkv.tables import Column, fit_table


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"


# Deliberate abbreviations so the groups table stays readable in an 80-column log;
# `--json` keeps the full names. `LEGEND` is printed under the table.
KIND_SHORT = {
    "full_attention": "full",
    "sliding_attention": "swa",
    "chunked_attention": "chunk",
    "mla": "mla",
    "state:gated_delta_net": "gdn",
    "state:mamba2": "mamba2",
    "state:mamba1": "mamba1",
    "state:short_conv": "sconv",
    "state:kda": "kda",
    "state:lightning": "light",
}
DTYPE_SHORT = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "fp8_e4m3": "e4m3",
    "fp8_e5m2": "e5m2",
}
LEGEND = (
    "page: raw (padded); kinds: full/swa/chunk = full/sliding/chunked attention, "
    "gdn = Gated DeltaNet, sconv = short conv; dtypes: bf16, fp16, fp32, e4m3/e5m2 = fp8"
)


def short_kind(kind: str) -> str:
    return KIND_SHORT.get(kind, kind)


def short_spec(text: str) -> str:
    for long, short in DTYPE_SHORT.items():
        text = text.replace(long, short)
    return text


def _layer_span(names: list[str]) -> str:
    """Layer names as runs that show every gap: main.0, main.1, main.3, main.4, draft.0
    -> "main.0-1,3-4 draft.0" (a name without a numeric suffix is written whole)."""
    parts: list[str] = []
    runs: list[list[int]] = []
    prefix: str | None = None

    def flush() -> None:
        if prefix is not None:
            spans = [str(a) if a == b else f"{a}-{b}" for a, b in ((r[0], r[-1]) for r in runs)]
            parts.append(f"{prefix}.{','.join(spans)}")

    for name in names:
        head, _, tail = name.rpartition(".")
        if not head or not tail.isdigit():
            flush()
            prefix, runs = None, []
            parts.append(name)
            continue
        index = int(tail)
        if head != prefix:
            flush()
            prefix, runs = head, [[index]]
        elif runs[-1][-1] + 1 == index:
            runs[-1].append(index)
        else:
            runs.append([index])
    flush()
    return " ".join(parts)


def _row_key(g: GroupPlan) -> tuple[object, ...]:
    return (
        g.model,
        g.spec,
        g.block_size,
        g.page_bytes,
        g.padded_page_bytes,
        g.pool_id,
        len(g.layers),
    )


GROUP_COLUMNS = [
    Column("ids"),
    Column("model"),
    Column("kind"),
    Column("spec", breaks=", ", min_width=16),
    Column("layers", breaks=", ", min_width=20),
    Column("block", justify="right"),
    Column("page", justify="right"),
    Column("pool", justify="right"),
]


def groups_table(plan: CachePlan, width: int) -> RenderableType:
    """One row per run of consecutive groups that differ only in their layers."""
    runs: list[list[GroupPlan]] = []
    for g in plan.groups:
        if runs and _row_key(runs[-1][-1]) == _row_key(g):
            runs[-1].append(g)
        else:
            runs.append([g])
    rows = []
    for run in runs:
        g = run[0]
        ids = str(g.group_id) if len(run) == 1 else f"{g.group_id}-{run[-1].group_id}"
        layers = [r.name for group in run for r in group.layers]
        per_group = f"{len(run)} x {len(g.layers)}" if len(run) > 1 else str(len(g.layers))
        page = format_bytes(g.page_bytes)
        if g.padded_page_bytes != g.page_bytes:
            page += f"\n({format_bytes(g.padded_page_bytes)})"
        rows.append(
            [
                ids,
                g.model,
                short_kind(g.kind + (f":{g.state_family}" if g.state_family else "")),
                short_spec(g.spec.describe()),
                f"{per_group}:\n{_layer_span(layers)}",
                str(g.block_size),
                page,
                str(g.pool_id),
            ]
        )
    return fit_table(f"groups (layout {plan.layout})", GROUP_COLUMNS, rows, width)


POOL_COLUMNS = [
    Column(name, justify="left" if name == "packing" else "right")
    for name in ("pool", "packing", "page", "pages", "tensors", "bytes")
] + [Column("groups", breaks=",")]


def pools_table(plan: CachePlan, width: int) -> RenderableType:
    rows = []
    for p in plan.pools:
        groups = ",".join(map(str, p.group_ids))
        if len(p.group_ids) > 4 and list(p.group_ids) == list(
            range(p.group_ids[0], p.group_ids[-1] + 1)
        ):
            groups = f"{p.group_ids[0]}-{p.group_ids[-1]}"
        rows.append(
            [
                str(p.pool_id),
                p.packing,
                format_bytes(p.page_bytes),
                str(p.num_pages),
                str(p.num_tensors),
                format_bytes(p.total_bytes),
                groups,
            ]
        )
    return fit_table("pools", POOL_COLUMNS, rows, width)


COMPARISON_COLUMNS = [
    Column("layout"),
    Column("requests @target", justify="right"),
    Column("requests @typical", justify="right"),
    Column("padding", justify="right"),
    Column("attention blocks", breaks=","),
    Column("hit granularity", justify="right"),
]


def comparison_table(plan: CachePlan, width: int) -> RenderableType:
    cap = plan.capacity
    rows = []
    for p in (plan, *plan.alternatives):
        s = p.summary()
        mark = " *" if p is plan else ""
        rows.append(
            [
                p.layout + mark,
                f"{s['max_concurrency']} ({s['max_concurrency_float']})",
                str(s["concurrency_at_typical_len"]),
                f"{p.waste_fraction:.2%}",
                ",".join(map(str, s["attention_block_sizes"])),
                str(s["hit_granularity_tokens"]),
            ]
        )
    title = f"layouts at {cap.target_len} tokens (typical {cap.typical_len})"
    return fit_table(title, COMPARISON_COLUMNS, rows, width)


def render(plan: CachePlan, console: Console | None = None) -> None:
    console = console or Console()
    cap = plan.capacity
    head = (
        f"[bold]{plan.main_model}[/bold]"
        + (f" + draft [bold]{plan.draft_model}[/bold]" if plan.draft_model else "")
        + f"  memory {format_bytes(plan.memory_bytes)}, used {format_bytes(plan.used_bytes)}, "
        f"padding {format_bytes(plan.waste_bytes)} ({plan.waste_fraction:.2%})"
    )
    lines = [
        f"max concurrency at {cap.target_len} tokens: [bold]{cap.max_concurrency}[/bold] "
        f"({cap.max_concurrency_float:.2f}); at {cap.typical_len}: {cap.concurrency_at_typical}",
        f"state slots: {cap.state_slots}; max_num_seqs {cap.max_num_seqs} "
        + (
            "fits"
            if cap.max_num_seqs_fits
            else f"does NOT fit (largest {cap.max_num_seqs_that_fit})"
        ),
    ]
    if plan.reason:
        lines.append(f"why: {plan.reason}")
    console.print(head)
    width = console.width
    console.print(Group(groups_table(plan, width), LEGEND, pools_table(plan, width)))
    if plan.alternatives:
        console.print(comparison_table(plan, width))
    for line in lines:
        console.print(line)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")

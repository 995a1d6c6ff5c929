"""Tables, plots and results.md of `prefix_policies.py` (rows: its `run_one` dicts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

VLLM_OWN = "vLLM's manager"  # the policy name of vLLM's own KVCacheManager rows


def render(rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    cols = (
        "family",
        "model",
        "spec",
        "GiB",
        "policy",
        "layout",
        "gran",
        "hit",
        "bound",
        "of bound",
        "of block bound",
        "vs vllm",
        "ckpts",
        "evictions",
        "preempt",
        "wall s",
    )
    for col in cols:
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["family"],
            r["model"],
            r["spec"],
            f"{r['memory_gib']:g}",
            r["policy"],
            r["layout"],
            str(r["granularity"]),
            f"{r['hit']:.3f}",
            f"{r['bound']:.3f}",
            f"{r['of_bound']:.1%}",
            f"{r['of_block_bound']:.1%}",
            "-" if r["vs_vllm"] is None else f"{r['vs_vllm']:.2f}x",
            str(r["checkpoints"]),
            str(r["evictions"]),
            str(r["preemptions"]),
            f"{r['wall_s']:.1f}",
        )
    Console(width=220).print(table)


def plot(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One PNG per (family, model, spec) with more than one memory size: hit rate vs
    memory, a line per policy, the reuse bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    keys = sorted({(r["family"], r["model"], r["spec"]) for r in rows})
    for family, model, spec in keys:
        sub = [r for r in rows if (r["family"], r["model"], r["spec"]) == (family, model, spec)]
        memories = sorted({r["memory_gib"] for r in sub})
        if len(memories) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in dict.fromkeys(r["policy"] for r in sub):
            points = sorted((r["memory_gib"], r["hit"]) for r in sub if r["policy"] == policy)
            ax.plot([m for m, _ in points], [h for _, h in points], marker="o", label=policy)
        ax.axhline(sub[0]["bound"], linestyle="--", color="gray", label="reuse bound")
        ax.set_xlabel("cache memory (GiB)")
        ax.set_ylabel("prefix hit rate")
        ax.set_ylim(0, 1)
        ax.set_title(f"{family}: {model}, spec {spec}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        slug = f"{family}_{model.split()[0]}_{spec}".replace(".", "")
        path = folder / f"{slug}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def markdown(rows: list[dict[str, Any]], command: str, wall_s: float) -> str:
    """results.md: share of the bound with memory to spare, then every hit rate."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    keys = list(dict.fromkeys((r["family"], r["model"], r["spec"]) for r in rows))
    by = {(r["family"], r["model"], r["spec"], r["memory_gib"], r["policy"]): r for r in rows}
    out = [
        "# Prefix policies: measured hit rates",
        "",
        f"Produced by `{command}` (seed 0; {wall_s:.0f} s of simulation on 2 shared CPU "
        "cores). Hit rate = "
        "prefix-hit prompt tokens / prompt tokens (first admissions); bound = the "
        "token-exact reuse bound of the trace. `default` = the manager's defaults (align + "
        "junction + turn_end rules + chain eviction); `vllm rule` = our `vllm` layout, "
        f"align, no extra rule, LRU; `{VLLM_OWN}` = vLLM's own KVCacheManager (vLLM "
        "0.33, CPU) under the same scheduler, trace and pool. qwen3.5-9b at max_model_len "
        "32768; spec methods with K = 3 (mtp/eagle include the head as draft layers; "
        "draft = qwen3-0.6b); roundrobin: 24 sessions x 6 turns on a 60-layer model "
        "(8 KV heads x 128, window 1024), fp8, block 16.",
        "",
        "## Share of the reuse bound with the most memory of each sweep",
        "",
        "| family | model | spec | GiB | bound | " + " | ".join(policies) + " |",
        "|---" * (5 + len(policies)) + "|",
    ]
    for family, model, spec in keys:
        top = max(
            r["memory_gib"]
            for r in rows
            if (r["family"], r["model"], r["spec"]) == (family, model, spec)
        )
        cells = []
        bound = None
        for policy in policies:
            r = by.get((family, model, spec, top, policy))
            cells.append("-" if r is None else f"{r['of_bound']:.1%}")
            bound = bound if r is None else r["bound"]
        out.append(
            f"| {family} | {model.split()[0]} | {spec} | {top:g} | {bound:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    out += [
        "",
        "## Hit rate, every memory size",
        "",
        "| family | model | spec | GiB | bound | " + " | ".join(policies) + " |",
        "|---" * (5 + len(policies)) + "|",
    ]
    for family, model, spec in keys:
        memories = sorted(
            {
                r["memory_gib"]
                for r in rows
                if (r["family"], r["model"], r["spec"]) == (family, model, spec)
            }
        )
        for memory in memories:
            cells = []
            bound = None
            for policy in policies:
                r = by.get((family, model, spec, memory, policy))
                cells.append("-" if r is None else f"{r['hit']:.3f}")
                bound = bound if r is None else r["bound"]
            out.append(
                f"| {family} | {model.split()[0]} | {spec} | {memory:g} | {bound:.3f} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(out) + "\n"


BELADY_BEGIN = "<!-- belady section: bench/prefix_policies.py --belady -->"
BELADY_END = "<!-- end of belady section -->"


def belady_markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The offline-reference section: hit rate of `default`, the best online chat policy
    and Belady's MIN per memory size; chat rows add the junction partial estimate."""
    by = {(r["family"], r["model"], r["spec"], r["memory_gib"], r["policy"]): r for r in rows}
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    online = [p for p in policies if "belady" not in p]
    wall_s = sum(r["wall_s"] for r in rows)
    out = [
        BELADY_BEGIN,
        "## Offline reference: Belady's MIN",
        "",
        f"Produced by `{command}` ({wall_s:.0f} s of simulation). Belady's MIN "
        "(`hybridkv.sim.belady`, simulator only: it reads the trace's future) evicts the "
        "cached block whose next use is furthest away, chains tail first; it is optimal "
        "for one cache of equal pages, a reference (not a bound) when a hit needs state "
        "checkpoints and attention blocks at once (chat on qwen3.5-9b). `+junction "
        "partial` = the same online policy's hit plus the estimate of "
        "`hybridkv.sim.junction_estimate` (an entry at every mid-block divergence point; "
        "needs copy-on-write in the engine, not built).",
        "",
        "| family | model | spec | GiB | bound | "
        + " | ".join(online)
        + " | Belady (offline) | "
        + " | ".join(f"{p} +junction partial" for p in online)
        + " |",
        "|---" * (5 + 2 * len(online) + 1) + "|",
    ]
    keys = list(dict.fromkeys((r["family"], r["model"], r["spec"], r["memory_gib"]) for r in rows))
    for key in keys:
        first = next(
            r for r in rows if (r["family"], r["model"], r["spec"], r["memory_gib"]) == key
        )
        cells = [key[0], key[1].split()[0], key[2], f"{key[3]:g}", f"{first['bound']:.3f}"]
        for p in online:
            r = by.get((*key, p))
            cells.append(f"{r['hit']:.3f}" if r else "-")
        belady = next((by[(*key, p)] for p in policies if "belady" in p and (*key, p) in by), None)
        cells.append(f"{belady['hit']:.3f}" if belady else "-")
        for p in online:
            r = by.get((*key, p))
            if r is None or r["family"] != "chat":
                cells.append("-")
                continue
            estimate = r["hit"] + r["junction_gain"]
            cells.append(f"{estimate:.3f} ({estimate / r['bound']:.1%})")
        out.append("| " + " | ".join(cells) + " |")
    out.append(BELADY_END)
    return "\n".join(out) + "\n"


def replace_section(path: Path, section: str) -> None:
    """Put ``section`` in place of the marked one in ``path`` (appended if none)."""
    text = path.read_text() if path.exists() else ""
    if BELADY_BEGIN in text and BELADY_END in text:
        head, rest = text.split(BELADY_BEGIN, 1)
        tail = rest.split(BELADY_END, 1)[1].lstrip("\n")
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)

"""Tree drafts vs chains on the demo: mean accepted length at equal draft-token counts.

Question: with the trained demo MTP head, does a token tree of N nodes accept more per
main pass than the best chain of N drafts, with the output still equal to greedy
decoding without speculation?

Setup: the demo main (byte-level Qwen3.5 hybrid) and its MTP head, the demo prompts,
greedy, ``--num-requests`` requests x ``--max-new-tokens`` tokens, float32, CPU. For
each N, chains K = 1..N (the best one is the bar: a longer chain is not always better)
and trees of N nodes: ``topk`` k (`TokenTree.from_topk`) and the hand-written shapes in
``HAND_TREES``. Also prints how often the head's r-th choice at depth 1 is the main
model's token (a 4-wide depth-1 tree), the numbers behind `DEFAULT_RANK_RATES`.

Run: ``PYTHONPATH=src python bench/tree_drafts.py`` (``--sizes 2,3,4``). Prints one row
per configuration: N, shape, mean accepted length (tokens per main pass), drafts
proposed, accepted, exact (output == non-speculative greedy), wall seconds.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.demo import DEMO_MAIN, DEMO_MAX_MODEL_LEN, DEMO_MEMORY_BYTES, DEMO_MTP, demo_prompts
from hybridkv.engine import LLM
from hybridkv.engine.speculative import tree as tree_mod
from hybridkv.plan.tree import TokenTree

HAND_TREES: dict[int, list[list[list[int]]]] = {
    2: [[[0], [1]]],
    3: [[[0], [1], [0, 0]], [[0], [1], [2]]],
    4: [[[0], [1], [0, 0], [0, 0, 0]], [[0], [1], [0, 0], [1, 0]], [[0], [1], [2], [0, 0]]],
    5: [[[0], [1], [0, 0], [1, 0], [0, 0, 0]], [[0], [1], [0, 0], [0, 1], [0, 0, 0]]],
    6: [[[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]],
}


MEMORY_BYTES = DEMO_MEMORY_BYTES


@dataclass(frozen=True)
class Row:
    stats: Any  # EngineStats
    num_draft_steps: int  # verify steps that carried drafts


def run(prompts: list[str], max_new: int, **spec: Any) -> tuple[list[list[int]], Row, float]:
    llm = LLM(
        DEMO_MAIN,
        memory_bytes=MEMORY_BYTES,
        max_model_len=DEMO_MAX_MODEL_LEN,
        max_num_seqs=max(8, len(prompts)),
        max_num_batched_tokens=1024,
        **({"draft": DEMO_MTP, "spec_method": "mtp"} if spec else {}),
        **spec,
    )
    start = time.perf_counter()
    out = [r.token_ids for r in llm.generate(prompts, max_new, ignore_eos=True)]
    wall = time.perf_counter() - start
    llm.manager.check_invariants()
    return out, Row(llm.stats(), llm.stepper.spec.num_draft_steps), wall


def depth1_rank_rates(prompts: list[str], max_new: int, width: int = 4) -> list[float]:
    """Share of verify steps whose accepted depth-1 node had rank r (a width-wide tree
    of depth 1)."""
    ranks: Counter[int] = Counter()
    steps = 0
    accept = tree_mod.accept_tree

    def counting(best: Any, tokens: Any, parents: Any) -> Any:
        nonlocal steps
        verdict = accept(best, tokens, parents)
        steps += 1
        if verdict.path:
            ranks[verdict.path[0]] += 1
        return verdict

    tree_mod.accept_tree = counting  # type: ignore[assignment]
    try:
        run(prompts, max_new, spec_tree=[[r] for r in range(width)])
    finally:
        tree_mod.accept_tree = accept  # type: ignore[assignment]
    return [ranks[r] / steps for r in range(width)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,3,4", help="draft-token counts N")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--memory-mib", type=int, default=DEMO_MEMORY_BYTES >> 20, help="cache budget"
    )
    args = parser.parse_args()
    global MEMORY_BYTES
    MEMORY_BYTES = args.memory_mib << 20
    torch.set_num_threads(args.threads)
    prompts = demo_prompts(args.num_requests)
    want, _, base_wall = run(prompts, args.max_new_tokens)
    print(f"no speculation: {base_wall:.2f} s")
    rates = depth1_rank_rates(prompts, args.max_new_tokens)
    print("depth-1 acceptance by rank: " + ", ".join(f"r{r} {x:.3f}" for r, x in enumerate(rates)))
    print(
        f"{'N':>2}  {'shape':<46} {'mean acc len':>12} {'proposed':>8} {'accepted':>8} "
        f"{'steps':>6} {'drafted':>7} {'preempt':>7} exact"
    )
    for n in [int(x) for x in args.sizes.split(",")]:
        configs: list[tuple[str, dict[str, Any]]] = [
            (f"chain K={k}", {"num_spec_tokens": k}) for k in range(1, n + 1)
        ]
        configs += [
            (
                f"topk=2 {list(map(list, TokenTree.from_topk(2, n).paths))}",
                {"spec_topk": 2, "num_spec_tokens": n},
            )
        ]
        configs += [(f"tree {paths}", {"spec_tree": paths}) for paths in HAND_TREES.get(n, [])]
        for name, spec in configs:
            got, row, wall = run(prompts, args.max_new_tokens, **spec)
            stats = row.stats
            print(
                f"{n:>2}  {name:<46} {stats.mean_accepted_length:>12.3f} "
                f"{stats.num_proposed_tokens:>8} {stats.num_accepted_tokens:>8} "
                f"{stats.num_verify_steps:>6} {row.num_draft_steps:>7} "
                f"{stats.num_preemptions:>7} {got == want}  ({wall:.1f} s)"
            )


if __name__ == "__main__":
    main()

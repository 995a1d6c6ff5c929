"""Tree drafts (top-k > 1 per position, or an explicit token tree): refused, with what
is missing named.

A tree of drafts verified in one main pass needs three pieces that do not exist here:

- a tree attention mask in the verification pass (each draft sees its ancestors only;
  the engine verifies one chain, causally);
- for state layers (Gated DeltaNet, Mamba, short conv ...), one recurrent state per
  branch point, so that the accepted path's state is exact (the planner keeps S = K
  speculative slots for one chain; a tree of N nodes needs N);
- a tree-aware commit: the accepted path's blocks and checkpoints kept, every other
  branch's released (the cache manager commits a chain prefix).

Until they exist every entry point (`LLM`, the CLI's ``--speculative-config``) calls
`check_chain_drafts`, which raises instead of planning a tree as a chain.
"""

from __future__ import annotations

from hybridkv.errors import PlanError
from hybridkv.spec.layers import StateSpec
from hybridkv.spec.model import ModelSpec

TREE_KEYS = ("topk", "speculative_token_tree")  # --speculative-config keys that ask for trees


def check_chain_drafts(
    topk: int = 1,
    token_tree: object = None,
    *,
    main: ModelSpec | None = None,
    draft: ModelSpec | None = None,
) -> None:
    """`PlanError` unless the drafts form one chain (``topk`` 1, no token tree)."""
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise PlanError(f"topk={topk!r}: must be a positive integer (1: a chain of drafts)")
    if topk == 1 and not token_tree:
        return
    if topk > 1:
        asked = f"topk={topk}"
    elif isinstance(token_tree, list):
        asked = f"a token tree of {len(token_tree)} nodes"
    else:
        asked = "a token tree"
    missing = [
        "a tree attention mask in the verification pass (the engine verifies one chain)",
        "a tree-aware commit (the cache manager keeps a chain prefix, not one branch of many)",
    ]
    states = []
    for model in (main, draft):
        if model is None:
            continue
        indices = [i for i, layer in enumerate(model.layers) if isinstance(layer, StateSpec)]
        if indices:
            states.append(f"{model.name} layers {indices}")
    if states:
        missing.append(
            "one recurrent state per branch point for the state layers ("
            + "; ".join(states)
            + "); vLLM refuses trees for such models too"
        )
    raise PlanError(
        f"tree drafts ({asked}) are not supported: missing "
        + "; ".join(missing)
        + ". Use topk=1 (a chain of num_speculative_tokens drafts)."
    )

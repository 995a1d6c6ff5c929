"""`CacheRules`: what a cache manager was asked to do, fixed when it is built.

`CacheManager` turns its keywords into one record (`CacheRules.for_plan`) and hands it
down its constructors: the coordinator, every pool (and its free queue) and every group
manager set their own attributes from it in their own ``__init__``; nothing is switched
on afterwards. A pool or group built alone (a unit test) takes the bare defaults below:
prefix caching on, lru eviction, no extra checkpoint rule.

Which flags follow from which keywords::

    checkpoint_rules  prefix caching  state group   ->  turn_end  junction  junction_copies
    turn_end          on              any               yes       -         -
    junction          any             yes               -         yes       -
    junction+turn_end on              yes               yes       yes       yes
    anything          off             ...               no turn_end (nothing is cached)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.errors import CacheError
from hybridkv.plan.types import CachePlan

EVICTION_POLICIES = ("lru", "chain")
DEFAULT_EVICTION_POLICY = "chain"  # wins bench/prefix_policies.py (no cliff under loops)
# extra checkpoint rules: junction (managers/state.py), turn_end (cache/turn_end.py)
CHECKPOINT_RULES = ("junction", "turn_end")
# Both on by default (bench/prefix_policies.py, docs/prefix_policies/results.md):
# junction is never below align and up to 1.6x hits under pressure; turn_end takes
# multi-turn sessions from ~91% to ~97% of the reuse bound with memory to spare, and
# its entries are evicted first, so under pressure it costs at most ~1% of hits.
DEFAULT_CHECKPOINT_RULES = ("junction", "turn_end")


@dataclass(frozen=True)
class CacheRules:
    """The switches of one cache manager (see `CacheManager` for each keyword).

    ``prefix_caching``: blocks are hashed, cached and hit. ``eagle``: draft layers are an
    EAGLE / MTP head (their groups key blocks one token ahead). ``eviction_policy``:
    ``lru`` or ``chain`` (`cache.free_queue`, `cache.chain_queue`). ``checkpoint_rules``:
    the extra rules as asked for; ``turn_end``, ``junction`` and ``junction_copies`` say
    which of them act on this plan (table in the module docstring).
    ``checkpoints_inside_steps``: state groups may checkpoint inside a step (False: only
    where a step ends, vLLM's workers). ``state_layout``: ``slots`` or ``columns``
    (`cache.managers`). ``drafter_lookahead_tokens``: the part of every step's lookahead
    that reserves the drafter's own KV (the ``columns`` layout places its running column
    by the drafts alone).
    """

    prefix_caching: bool = True
    eagle: bool = False
    hash_algo: str = "sha256"
    eviction_policy: str = "lru"
    checkpoint_rules: tuple[str, ...] = ()
    turn_end: bool = False
    junction: bool = False
    junction_copies: bool = False
    checkpoints_inside_steps: bool = True
    state_layout: str = "slots"
    drafter_lookahead_tokens: int = 0

    @property
    def chain(self) -> bool:
        """The chain eviction policy (the only one that reads hit and hot releases)."""
        return self.eviction_policy == "chain"

    @classmethod
    def for_plan(
        cls,
        plan: CachePlan,
        *,
        enable_prefix_caching: bool | None = None,
        eagle: bool = False,
        hash_algo: str = "sha256",
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
        checkpoint_rules: Sequence[str] | None = None,
        checkpoints_inside_steps: bool = True,
        state_layout: str = "slots",
        drafter_lookahead_tokens: int = 0,
    ) -> CacheRules:
        """The rules `CacheManager` keywords ask for on ``plan``; raises `CacheError`
        naming the bad value and the accepted ones."""
        caching = (
            plan.options.prefix_caching if enable_prefix_caching is None else enable_prefix_caching
        )
        if eviction_policy not in EVICTION_POLICIES:
            raise CacheError(
                f"eviction policy {eviction_policy!r} is unknown; use one of "
                f"{', '.join(EVICTION_POLICIES)}"
            )
        rules = DEFAULT_CHECKPOINT_RULES if checkpoint_rules is None else tuple(checkpoint_rules)
        unknown = sorted(set(rules) - set(CHECKPOINT_RULES))
        if unknown:
            raise CacheError(
                f"checkpoint rules {unknown} are unknown; use any of {list(CHECKPOINT_RULES)}"
            )
        if drafter_lookahead_tokens < 0:
            raise CacheError(f"drafter_lookahead_tokens={drafter_lookahead_tokens}: must be >= 0")
        has_state = any(group.is_state for group in plan.groups)
        junction = "junction" in rules and has_state
        turn_end = "turn_end" in rules and caching
        # Mid-block hits by copy-on-write, with the junction rule, so only in plans with
        # a state group: there a block holds hundreds of tokens (a copy serves up to
        # block_size - 1 of them) and the junction's state needs the copy to be reached.
        # Attention-only plans (block 16: at most 15 tokens a hit) gain little and pay
        # for a child index of every cached block: qwen3-4b over the prefix study's
        # families +0.3 points of the reuse bound (few-shot), -1.7 (chat at 5 GiB),
        # within 0.04 elsewhere; ~20% of manager time (bench/manager_step.py, full).
        # See docs/prefix_policies/junction_copies.md.
        return cls(
            prefix_caching=caching,
            eagle=eagle,
            hash_algo=hash_algo,
            eviction_policy=eviction_policy,
            checkpoint_rules=rules,
            turn_end=turn_end,
            junction=junction,
            junction_copies=turn_end and junction,
            checkpoints_inside_steps=checkpoints_inside_steps,
            state_layout=state_layout,
            drafter_lookahead_tokens=drafter_lookahead_tokens,
        )

"""Build one `ForwardBatch` per step from the scheduler's chunks and the
`CacheManager`'s block tables and state slots, run the model, return the logits.

Per attention group, request ``r``'s row is ``manager.block_table(r, g)`` padded with
the null block, kept on the device across steps and updated from the scheduler's
per-step deltas by whoever drives the runner (`block_tables.DeviceBlockTables`,
`Stepper`); a sliding-window row may hold null blocks for positions that left the
window (attention never reads them). Per state group,
`CacheManager.state_slots` turns into one read slot and a list of write points,
counted in new tokens ``k`` of this step (``c`` = computed tokens before the step)::

    read          read_block (None: zeros)
    (W - c, w)    write_block gets the state after write_num_tokens = W tokens
    (P - c, b)    each checkpoint (P, b): the state after exactly P tokens (align: at
                  most one per step; all / junction: one per boundary inside the chunk)
    (W - c + i + 1, spec_blocks[i])   the state after draft i + 1 (drafts follow the
                  n verified tokens in the step)

Example, checkpoint interval 16, c = 10, a 20-token chunk: read the running block,
points (20, write) and (6, checkpoint block at 16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hybridkv.cache import CacheManager, StepSlots
from hybridkv.engine.forward.block_tables import DeviceBlockTables
from hybridkv.engine.forward.tensors import CacheTensors, group_key
from hybridkv.engine.models.common import CausalLM, HiddenStates
from hybridkv.engine.ops.context import BlockTable, ForwardBatch, StateSlots, WritePoint, make_batch
from hybridkv.engine.ops.scratch import Scratch
from hybridkv.engine.ops.tree_batch import TreeLayout
from hybridkv.errors import EngineError
from hybridkv.plan.types import CachePlan


@dataclass(frozen=True)
class StepInput:
    """One request's tokens in a step: ``token_ids`` start at position ``num_computed``;
    the last ``num_draft_tokens`` of them are unverified drafts (their logits are
    returned too, for verification). ``draft_pass`` j >= 1 marks the j-th single-token
    pass of a draft model over the step allocated for ``c`` computed tokens: its token
    sits at ``c + j - 1`` (see `draft_pass_points`)."""

    req_id: str
    token_ids: Sequence[int]
    num_computed: int
    num_draft_tokens: int = 0
    draft_pass: int = 0
    # Token tree over ``token_ids`` (`tree_batch`: parent per token, -1: the context);
    # None: a plain causal chunk.
    parents: tuple[int, ...] | None = None
    # Logits at every token of the step, not only the last 1 + num_draft_tokens
    # (prompt logprobs, `engine.sampling.logprobs`).
    all_logits: bool = False

    @property
    def num_logit_rows(self) -> int:
        return len(self.token_ids) if self.all_logits else 1 + self.num_draft_tokens


def state_write_points(
    read_block: int | None,
    write_block: int,
    write_num_tokens: int,
    spec_blocks: Sequence[int],
    checkpoints: Sequence[tuple[int, int]] | None,
    num_computed: int,
    num_draft_tokens: int | None = None,
) -> tuple[int | None, list[WritePoint]]:
    """A manager `StateSlots` as (read slot, write points in new tokens of the step).
    ``num_draft_tokens`` (default: all spec blocks) limits the spec points to the drafts
    this pass actually carries."""
    base = write_num_tokens - num_computed
    points: list[WritePoint] = [(base, int(write_block))]
    used = spec_blocks if num_draft_tokens is None else spec_blocks[:num_draft_tokens]
    points += [(base + i + 1, int(block)) for i, block in enumerate(used)]
    # align: at most one; all / junction: one per boundary inside the chunk
    points += [(pos - num_computed, int(block)) for pos, block in checkpoints or ()]
    return (None if read_block is None else int(read_block)), points


def draft_pass_points(
    read_block: int | None, write_block: int, spec_blocks: Sequence[int], draft_pass: int
) -> tuple[int | None, list[WritePoint]]:
    """Read slot and write point of single-token draft pass ``j`` (step: c computed,
    n = 1 verified, L drafts; pass j runs the token at position c + j - 1)::

        pass j     1            2              3              ..  L + 1
        input      T[-1] @ c    d1 @ c+1       d2 @ c+2           dL @ c+L
        reads      read_block   write_block    spec_blocks[0]     spec_blocks[L-2]
        writes     write_block  spec_blocks[0] spec_blocks[1]     spec_blocks[L-1]

    so after commit(a) the running state (spec slot a - 1, or write for a = 0) is the
    state after c + 1 + a tokens, exactly as for the main model.
    """
    chain = [int(write_block), *map(int, spec_blocks)]
    if not 1 <= draft_pass <= len(chain):
        raise EngineError(f"draft pass {draft_pass} outside 1..{len(chain)} (spec slots held)")
    read = (
        (None if read_block is None else int(read_block))
        if draft_pass == 1
        else (chain[draft_pass - 2])
    )
    return read, [(1, chain[draft_pass - 1])]


class ModelRunner:
    """Runs one model (``model_name`` "main" or "draft") over the groups the plan gives
    it, with the cache views of that model. ``tables``: the persistent block tables
    (shared between runners; the caller applies each step's deltas to them)."""

    def __init__(
        self,
        model: CausalLM,
        plan: CachePlan,
        manager: CacheManager,
        tensors: CacheTensors,
        model_name: str = "main",
        tables: DeviceBlockTables | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.manager = manager
        self.tensors = tensors
        self.caches = tensors.caches if model_name == "main" else tensors.draft_caches
        self.device = model.device  # batches go where the weights are
        # A group may hold layers of both models ("main+draft"): same table, own pages.
        mine = [g for g in plan.groups if any(ref.model == model_name for ref in g.layers)]
        self.attention_groups = [g for g in mine if not g.is_state]
        self.state_groups = [g for g in mine if g.is_state]
        self.tables = DeviceBlockTables.for_plan(plan, self.device) if tables is None else tables
        self.scratch = Scratch()  # work buffers kept across steps

    def build_batch(self, steps: Sequence[StepInput]) -> ForwardBatch:
        tables: dict[str, BlockTable] = {}
        req_ids = [s.req_id for s in steps]
        for group in self.attention_groups:
            tables[group_key(group.group_id)] = self.tables.table(group.group_id, req_ids)
        slots: dict[str, StateSlots] = {}
        for group in self.state_groups:
            reads: list[int | None] = []
            writes: list[list[WritePoint]] = []
            got = self.manager.state_slots_many(req_ids, group.group_id)
            for s, st in zip(steps, got, strict=True):
                read, points = self._state_points(s, st)
                reads.append(read)
                writes.append(points)
            slots[group_key(group.group_id)] = StateSlots.from_points(reads, writes, self.device)
        indices: list[int] = []
        end = 0
        for s in steps:
            end += len(s.token_ids)
            indices.extend(range(end - s.num_logit_rows, end))
        batch = make_batch(
            [(list(s.token_ids), s.num_computed) for s in steps],
            tables,
            slots,
            torch.tensor(indices, dtype=torch.long, device=self.device),
            self.device,
            self.scratch,
        )
        if any(s.parents is not None for s in steps):  # token trees (`tree_batch`)
            starts = [(s.num_computed, len(s.token_ids)) for s in steps]
            tree = TreeLayout.build([s.parents for s in steps], starts, self.device)
            batch = replace(batch, tree=tree)
        return batch

    def _state_points(self, s: StepInput, st: StepSlots) -> tuple[int | None, list[WritePoint]]:
        step_start = s.num_computed - max(0, s.draft_pass - 1)
        if st.num_computed_tokens != step_start:
            raise EngineError(
                f"request {s.req_id!r}: the manager has {st.num_computed_tokens} "
                f"computed tokens, the step starts at {step_start}"
            )
        if s.draft_pass:
            return draft_pass_points(st.read_block, st.write_block, st.spec_blocks, s.draft_pass)
        return state_write_points(
            st.read_block,
            st.write_block,
            st.write_num_tokens,
            st.spec_blocks,
            st.checkpoints,
            s.num_computed,
            s.num_draft_tokens,
        )

    def check_invariants(self) -> None:
        """Every persistent block table matches its host rows (`PersistentBlockTable`)."""
        self.tables.check_invariants()

    def execute_with_hidden(
        self, steps: Sequence[StepInput], capture: Sequence[int] = ()
    ) -> tuple[list[torch.Tensor], HiddenStates]:
        """`execute`, plus the hidden states of every token (batch order: the steps'
        tokens one after the other) that a drafter head reads (`CausalLM.forward_with_hidden`)."""
        batch = self.build_batch(steps)
        batch.check()
        logits, hidden = self.model.forward_with_hidden(batch, self.caches, capture)
        return list(torch.split(logits, [s.num_logit_rows for s in steps])), hidden

    def execute(self, steps: Sequence[StepInput]) -> list[torch.Tensor]:
        """Run one step; per request, logits ``[num_logit_rows, vocab]`` at its last
        ``1 + num_draft_tokens`` tokens (every token with ``all_logits``)."""
        batch = self.build_batch(steps)
        batch.check()
        logits = self.model.forward(batch, self.caches)
        return list(torch.split(logits, [s.num_logit_rows for s in steps]))

"""Build one `ForwardBatch` per step from the scheduler's chunks and the
`CacheManager`'s block tables and state slots, run the model, return the logits.

Per attention group, request ``r``'s row is ``manager.block_table(r, g)`` padded with
the null block; a sliding-window row may hold null blocks for positions that left the
window (attention never reads them). Per state group, `CacheManager.state_slots` turns
into one read slot and a list of write points, counted in new tokens ``k`` of this step
(``c`` = computed tokens before the step)::

    read          read_block (None: zeros)
    (W - c, w)    write_block gets the state after write_num_tokens = W tokens
    (P - c, b)    checkpoint (P, b): the state after exactly P tokens (align mode)
    (W - c + i + 1, spec_blocks[i])   the state after draft i + 1 (drafts follow the
                  n verified tokens in the step)

Example, checkpoint interval 16, c = 10, a 20-token chunk: read the running block,
points (20, write) and (6, checkpoint block at 16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridkv.cache import CacheManager
from hybridkv.engine.context import BlockTable, ForwardBatch, StateSlots, WritePoint, make_batch
from hybridkv.engine.models.common import CausalLM
from hybridkv.engine.tensors import CacheTensors, group_key
from hybridkv.errors import EngineError
from hybridkv.plan.types import CachePlan
from hybridkv.spec.layers import STATE

NULL_BLOCK = 0


@dataclass(frozen=True)
class StepInput:
    """One request's tokens in a step: ``token_ids`` start at position ``num_computed``;
    the last ``num_draft_tokens`` of them are unverified drafts."""

    req_id: str
    token_ids: Sequence[int]
    num_computed: int
    num_draft_tokens: int = 0


def state_write_points(
    read_block: int | None,
    write_block: int,
    write_num_tokens: int,
    spec_blocks: Sequence[int],
    checkpoint: tuple[int, int] | None,
    num_computed: int,
) -> tuple[int | None, list[WritePoint]]:
    """A manager `StateSlots` as (read slot, write points in new tokens of the step)."""
    base = write_num_tokens - num_computed
    points: list[WritePoint] = [(base, int(write_block))]
    points += [(base + i + 1, int(block)) for i, block in enumerate(spec_blocks)]
    if checkpoint is not None:
        points.append((checkpoint[0] - num_computed, int(checkpoint[1])))
    return (None if read_block is None else int(read_block)), points


class ModelRunner:
    def __init__(
        self, model: CausalLM, plan: CachePlan, manager: CacheManager, tensors: CacheTensors
    ) -> None:
        self.model = model
        self.plan = plan
        self.manager = manager
        self.tensors = tensors
        main = [g for g in plan.groups if g.model == "main"]
        self.attention_groups = [g for g in main if g.kind != STATE]
        self.state_groups = [g for g in main if g.kind == STATE]

    def build_batch(self, steps: Sequence[StepInput]) -> ForwardBatch:
        tables: dict[str, BlockTable] = {}
        for group in self.attention_groups:
            rows = [self.manager.block_table(s.req_id, group.group_id) for s in steps]
            width = max(1, max(len(row) for row in rows))
            padded = [list(row) + [NULL_BLOCK] * (width - len(row)) for row in rows]
            tables[group_key(group.group_id)] = BlockTable(
                torch.tensor(padded, dtype=torch.long), group.block_size
            )
        slots: dict[str, StateSlots] = {}
        for group in self.state_groups:
            reads: list[int | None] = []
            writes: list[list[WritePoint]] = []
            for s in steps:
                st = self.manager.state_slots(s.req_id, group.group_id)
                if st.num_computed_tokens != s.num_computed:
                    raise EngineError(
                        f"request {s.req_id!r}: the manager has {st.num_computed_tokens} "
                        f"computed tokens, the step starts at {s.num_computed}"
                    )
                read, points = state_write_points(
                    st.read_block, st.write_block, st.write_num_tokens, st.spec_blocks,
                    st.checkpoint, s.num_computed,
                )
                reads.append(read)
                writes.append(points)
            slots[group_key(group.group_id)] = StateSlots.from_points(reads, writes)
        return make_batch(
            [(list(s.token_ids), s.num_computed) for s in steps], tables, slots
        )

    def execute(self, steps: Sequence[StepInput]) -> torch.Tensor:
        """Run one step; logits ``[len(steps), vocab]`` at each request's last token."""
        batch = self.build_batch(steps)
        batch.check()
        return self.model.forward(batch, self.tensors.caches)

"""A small self-made paged cache and greedy loop for exactness tests.

Not the real runner: block tables are laid out here by hand (shuffled block ids, block 0
reserved as the null block, one state slot per request), so the engine's forward passes
can be checked against `transformers` before the planner and cache manager exist.

Traps that make a wrong read visible as a wrong token:
* the null block (id 0) and every unused state slot are filled with NaN;
* sliding-window blocks that left the window are replaced by the null block;
* a request's state slot starts out NaN, so a fresh prefill must not read it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridkv.engine.models import CausalLM
from hybridkv.engine.models.common import SLIDING_ATTENTION, STATE
from hybridkv.engine.ops.context import (
    BlockTable,
    ForwardBatch,
    KVCache,
    LayerCache,
    StateCache,
    StateSlots,
    make_batch,
)

NULL_BLOCK = 0


def save_tiny(model_cls, config, folder: Path, seed: int = 0, **save_kwargs) -> torch.nn.Module:
    """Build a random-weight transformers model in float32 and save it to ``folder``."""
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder, **save_kwargs)
    return model


def hf_greedy(model: torch.nn.Module, prompts: Sequence[Sequence[int]], num_new: int) -> list:
    """Reference tokens: `generate` one prompt at a time (no padding), greedy."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.no_grad():
            # An explicit mask: otherwise prompt tokens equal to pad_token_id get masked.
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@dataclass
class PagedCache:
    """Caches for every layer plus per-request block tables and state slots."""

    model: CausalLM
    num_reqs: int
    max_len: int
    block_size: int
    seed: int = 0
    caches: dict[int, LayerCache] = field(default_factory=dict)
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    windows: dict[str, int] = field(default_factory=dict)
    slot_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        blocks_per_req = -(-self.max_len // self.block_size)
        num_blocks = 1 + self.num_reqs * blocks_per_req
        num_slots = 1 + self.num_reqs
        dtype = self.model.dtype
        for desc in self.model.layers:
            group = self._group(desc.kind, desc.sliding_window)
            if desc.kind == STATE:
                ssm_dtype = desc.ssm_dtype or dtype
                self.caches[desc.index] = StateCache(
                    conv=torch.full((num_slots, *desc.shapes["conv"]), float("nan"), dtype=dtype),
                    ssm=torch.full((num_slots, *desc.shapes["ssm"]), float("nan"), dtype=ssm_dtype),
                    group=group,
                )
                continue
            page = (num_blocks, self.block_size)
            self.caches[desc.index] = KVCache(
                key=torch.full((*page, *desc.shapes["key"]), float("nan"), dtype=dtype),
                value=torch.full((*page, *desc.shapes["value"]), float("nan"), dtype=dtype),
                group=group,
            )
            if group not in self.tables:
                ids = list(range(1, num_blocks))
                rng.shuffle(ids)
                self.tables[group] = torch.tensor(ids).view(self.num_reqs, blocks_per_req)
                if desc.sliding_window is not None:
                    self.windows[group] = desc.sliding_window
        slots = list(range(1, num_slots))
        rng.shuffle(slots)
        self.slot_ids = torch.tensor(slots)

    @staticmethod
    def _group(kind: str, window: int | None) -> str:
        return f"{kind}:{window}" if kind == SLIDING_ATTENTION else kind

    def batch(
        self, reqs: Sequence[int], chunks: Sequence[tuple[Sequence[int], int]]
    ) -> ForwardBatch:
        """A batch of ``chunks[i] = (new tokens, num_computed)`` for request ``reqs[i]``."""
        index = torch.tensor(list(reqs), dtype=torch.long)
        tables = {}
        for group, table in self.tables.items():
            rows = table[index].clone()
            window = self.windows.get(group)
            if window is not None:
                # Blocks wholly before the first key the window can see are released.
                for row, (_, computed) in zip(rows, chunks, strict=True):
                    first_key = max(0, computed - window + 1)
                    row[: first_key // self.block_size] = NULL_BLOCK
            tables[group] = BlockTable(rows, self.block_size)
        fresh = torch.tensor([computed == 0 for _, computed in chunks])
        slots = StateSlots(self.slot_ids[index], ~fresh)
        state_groups = {c.group for c in self.caches.values() if isinstance(c, StateCache)}
        return make_batch(chunks, tables, {g: slots for g in state_groups})


def engine_greedy(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    num_new: int,
    *,
    chunk_size: int | None,
    block_size: int,
    seed: int = 0,
    paged: PagedCache | None = None,
) -> list[list[int]]:
    """Greedy decoding with chunked prefill and decode steps batched across requests.

    Each step takes, for every unfinished request, either its next prompt chunk of up to
    ``chunk_size`` tokens (None: the whole rest of the prompt) or its last token. Pass a
    used ``paged`` cache to start every request over in slots and blocks that still hold
    another run's data (what recomputing a preempted request looks like).
    """
    if paged is None:
        max_len = max(len(p) for p in prompts) + num_new
        paged = PagedCache(model, len(prompts), max_len, block_size, seed)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(out) < num_new for out in outputs):
        reqs, chunks = [], []
        for r, out in enumerate(outputs):
            if len(out) >= num_new:
                continue
            todo = len(tokens[r]) - computed[r]
            take = todo if chunk_size is None else min(chunk_size, todo)
            reqs.append(r)
            chunks.append((tokens[r][computed[r] : computed[r] + take], computed[r]))
        batch = paged.batch(reqs, chunks)
        batch.check()
        logits = model.forward(batch, paged.caches)
        for i, r in enumerate(reqs):
            computed[r] += len(chunks[i][0])
            if computed[r] == len(tokens[r]):  # the chunk reached the end: sample
                token = int(torch.argmax(logits[i]))
                outputs[r].append(token)
                tokens[r].append(token)
    return outputs


def prompts_for(vocab: int, seed: int = 1) -> list[list[int]]:
    """Prompts of different lengths; two share a prefix, one is a single token."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(13)]
    return [
        shared + [rng.randrange(vocab) for _ in range(6)],
        [rng.randrange(vocab) for _ in range(27)],
        shared + [rng.randrange(vocab) for _ in range(2)],
        [rng.randrange(vocab)],
    ]

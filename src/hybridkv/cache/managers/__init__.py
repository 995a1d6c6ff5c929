"""Group managers, chosen from a table by the group's spec kind.

Adding a layer kind is one spec class, one manager class and one row here.
"""

from __future__ import annotations

from hybridkv.cache.managers.base import UNBOUNDED, Bounds, Counters, FastLimits, GroupManager
from hybridkv.cache.managers.chunked import ChunkedLocalManager
from hybridkv.cache.managers.full import FullAttentionManager, TableBlocks
from hybridkv.cache.managers.sliding import SlidingWindowManager
from hybridkv.cache.managers.state import StateBlocks, StateManager, StateSlots, StepSlots
from hybridkv.cache.managers.state_columns import ColumnBlocks, ColumnStateManager
from hybridkv.spec.layers import CHUNKED_ATTENTION, FULL_ATTENTION, MLA, SLIDING_ATTENTION, STATE

MANAGER_TABLE: dict[str, type[GroupManager]] = {
    FULL_ATTENTION: FullAttentionManager,
    MLA: FullAttentionManager,
    SLIDING_ATTENTION: SlidingWindowManager,
    CHUNKED_ATTENTION: ChunkedLocalManager,
    STATE: StateManager,
}
# How a state group hands its blocks to an engine: slots per step (hybridkv's engine) or
# the positional rows of vLLM's workers (`state_columns`, speculative decoding in vLLM).
STATE_LAYOUTS: dict[str, type[GroupManager]] = {
    "slots": StateManager,
    "columns": ColumnStateManager,
}

__all__ = [
    "MANAGER_TABLE",
    "STATE_LAYOUTS",
    "UNBOUNDED",
    "Bounds",
    "ChunkedLocalManager",
    "ColumnBlocks",
    "ColumnStateManager",
    "Counters",
    "FastLimits",
    "FullAttentionManager",
    "GroupManager",
    "SlidingWindowManager",
    "StateBlocks",
    "StateManager",
    "StateSlots",
    "StepSlots",
    "TableBlocks",
]

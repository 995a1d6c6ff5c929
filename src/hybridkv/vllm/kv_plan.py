"""vLLM's KV-cache groups as a `CachePlan` for hybridkv's `CacheManager`.

vLLM has already placed the tensors (one pool of ``num_blocks`` block ids shared by
every group, block 0 its null block, as in hybridkv's ``shared`` layout); the manager
only needs the block arithmetic: each group's kind, block size and window, the pool
size, the speculative rows and the state mode. Byte sizes stay vLLM's business, so the
plan carries nominal ones (`hybridkv.plan.nominal`).

Only class names of vLLM's specs are read (duck typing), so this module imports nothing
of vLLM and works for every supported version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.plan.nominal import GroupShape, nominal_plan
from hybridkv.plan.types import CachePlan


class UnsupportedVllmSetup(HybridKVError):
    """The vLLM engine uses something hybridkv's scheduler does not translate."""


@dataclass(frozen=True)
class VllmGroup:
    """One of vLLM's KV-cache groups as hybridkv sees it."""

    group_id: int
    kind: str  # full | sliding | chunked | state
    block_size: int
    span_tokens: int = 0  # window (sliding) or chunk (chunked)
    # holds an EAGLE / MTP head's layers: their KV at position p also depends on token
    # p + 1, so hybridkv keys the group's blocks one token ahead
    draft_head: bool = False


def _class_names(spec: Any) -> set[str]:
    return {cls.__name__ for cls in type(spec).__mro__}


def _leaf_spec(group_spec: Any) -> Any:
    """A group's spec; vLLM 0.33 may wrap same-kind layers in UniformTypeKVCacheSpecs."""
    spec = group_spec.kv_cache_spec
    if "UniformTypeKVCacheSpecs" in _class_names(spec):
        kinds = {type(s).__name__ for s in spec.kv_cache_specs.values()}
        if len(kinds) != 1:
            raise UnsupportedVllmSetup(
                f"a vLLM KV-cache group mixes layer specs {sorted(kinds)}; hybridkv's "
                "scheduler translates one kind per group"
            )
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def vllm_groups(kv_cache_config: Any, *, draft_head: bool = False) -> list[VllmGroup]:
    """hybridkv's view of ``kv_cache_config.kv_cache_groups``, in vLLM's order.

    ``draft_head``: the engine drafts with an EAGLE / MTP head. vLLM flags the groups that
    hold the head's layers (``is_eagle_group``; an MTP layer joins the main model's
    attention group) and, where it could flag none, treats every group as one; hybridkv
    keys the same attention groups one token ahead (state groups keep no head layers).
    """
    flagged = {
        gid
        for gid, group_spec in enumerate(kv_cache_config.kv_cache_groups)
        if getattr(group_spec, "is_eagle_group", False)
    }
    groups: list[VllmGroup] = []
    for gid, group_spec in enumerate(kv_cache_config.kv_cache_groups):
        spec = _leaf_spec(group_spec)
        names = _class_names(spec)
        block_size = int(spec.block_size)
        head = draft_head and (gid in flagged or not flagged)
        if names & {"CrossAttentionSpec", "EncoderOnlyAttentionSpec", "SinkFullAttentionSpec"}:
            kind = ""
        elif "MambaSpec" in names:
            kind = "state"
        elif "SlidingWindowSpec" in names:
            window = int(spec.sliding_window)
            groups.append(VllmGroup(gid, "sliding", block_size, window, draft_head=head))
            continue
        elif "ChunkedLocalAttentionSpec" in names:
            chunk = int(spec.attention_chunk_size)
            groups.append(VllmGroup(gid, "chunked", block_size, chunk, draft_head=head))
            continue
        elif "FullAttentionSpec" in names:  # MLA specs derive from it
            kind = "full"
        else:
            kind = ""
        if not kind:
            raise UnsupportedVllmSetup(
                f"vLLM KV-cache group {gid} ({type(spec).__name__}, layers "
                f"{list(group_spec.layer_names)[:3]}...) has no hybridkv manager; run without "
                "--scheduler-cls hybridkv.vllm.Scheduler"
            )
        groups.append(VllmGroup(gid, kind, block_size, draft_head=head and kind != "state"))
    if not groups:
        raise UnsupportedVllmSetup("vLLM's KV-cache config has no groups")
    return groups


def plan_for_vllm(
    groups: Sequence[VllmGroup],
    *,
    num_blocks: int,
    num_spec_tokens: int,
    prefix_caching: bool,
    state_mode: str,
) -> CachePlan:
    """The `CachePlan` whose pool and groups are vLLM's (ids and block sizes equal)."""
    if num_blocks < 2:
        raise UnsupportedVllmSetup(
            f"vLLM's KV cache has {num_blocks} blocks; hybridkv's scheduler needs >= 2 "
            "(block 0 is the null block)"
        )
    return nominal_plan(
        [
            GroupShape(g.kind, g.block_size, g.span_tokens, "draft" if g.draft_head else "main")
            for g in groups
        ],
        num_blocks=num_blocks,
        num_spec_tokens=num_spec_tokens,
        state_mode=state_mode,
        prefix_caching=prefix_caching,
        main_model="vllm",
    )

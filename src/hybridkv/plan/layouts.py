"""The three layouts: pure functions from layer classes and options to a `LayoutDraft`.

* ``shared``: one pool, one page size; any block goes to any group. The page size is
  chosen among candidates (each state page, and for each attention class the smallest
  aligned block whose page holds the largest state page); attention block sizes are
  scaled to fill the page before anything is padded; state pages are padded up.
* ``split``: one pool per group (= per class), natural pages, no padding; the split of
  memory between pools is static, sized for the target length and ``max_num_seqs``.
* ``vllm``: vLLM 0.33's rule, to predict what vLLM will do (see `vllm_layout`).

Each returns pools without page counts except ``split``; `capacity.build_plan` sizes
and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm

from hybridkv.errors import PlanError
from hybridkv.ids import cdiv, round_up
from hybridkv.plan.grouping import (
    LayerClass,
    group_size_candidates,
    merge_equal_specs,
    vllm_group_size,
)
from hybridkv.plan.types import LayerRef, PlanOptions
from hybridkv.spec.attention import ChunkedLocalSpec, SlidingWindowSpec
from hybridkv.spec.layers import MLASpec

SPLIT_STATE_INTERVAL_NO_ATTENTION = 256  # checkpoint interval of attention-free models
MAX_HIT_GRANULARITY_FACTOR = 8  # cap: lcm of block sizes <= 8 x the largest block
SLAB_ALIGN_BYTES = 16  # layer pages inside a slab start 16-byte aligned (any dtype view)
MAX_GROUPS = 32  # each group is one more block table per request and step


@dataclass
class GroupDraft:
    cls: LayerClass
    layers: tuple[LayerRef, ...]
    block_size: int
    page_bytes: int
    padded_page_bytes: int
    pool: int


@dataclass
class LayoutDraft:
    name: str
    groups: list[GroupDraft]
    pool_page_bytes: list[int]
    pool_num_tensors: list[int]
    pool_num_pages: list[int] | None = None  # None: one pool takes the whole budget
    notes: list[str] = field(default_factory=list)
    packing: str = "tensor"


def _attention(classes: list[LayerClass]) -> list[LayerClass]:
    return [c for c in classes if not c.is_state]


def _states(classes: list[LayerClass]) -> list[LayerClass]:
    return [c for c in classes if c.is_state]


def _main_attention(classes: list[LayerClass]) -> LayerClass | None:
    """The class whose block size defines the layout: main model's full attention first."""
    attn = _attention(classes)
    ranked = sorted(attn, key=lambda c: (not c.has_main, c.spec.kind != "full_attention"))
    return ranked[0] if ranked else None


def _state_interval(attention_block_sizes: list[int], fallback: int) -> int:
    """State checkpoints at a boundary of every attention group (their lcm)."""
    return lcm(*attention_block_sizes) if attention_block_sizes else fallback


def _max_state_page(classes: list[LayerClass], options: PlanOptions) -> int:
    return max((c.state_page_bytes(options.num_spec_states) for c in _states(classes)), default=0)


# --------------------------------------------------------------------------- shared


def _shared_for_page(
    classes: list[LayerClass], options: PlanOptions, page_bytes: int, group_size: int
) -> LayoutDraft | None:
    """Fit every class into ``page_bytes`` pages; None when an attention block would be
    empty or the hit granularity would exceed its cap."""
    sizes: dict[int, int] = {}
    for index, cls in enumerate(_attention(classes)):
        per_token = cls.bytes_per_token()
        align = options.block_align_tokens
        block = (page_bytes // per_token) // align * align
        if block == 0:
            return None
        sizes[index] = block
    blocks = list(sizes.values())
    interval = _state_interval(blocks, fallback=options.block_size or 256)
    if blocks and interval > MAX_HIT_GRANULARITY_FACTOR * max(blocks):
        return None
    groups: list[GroupDraft] = []
    attn_index = 0
    for cls in classes:
        if cls.is_state:
            block = interval
            raw = cls.state_page_bytes(options.num_spec_states)
        else:
            block = sizes[attn_index]
            attn_index += 1
            raw = block * cls.bytes_per_token()
        groups.extend(
            GroupDraft(cls, chunk, block, raw, page_bytes, 0) for chunk in cls.chunks(group_size)
        )
    return LayoutDraft("shared", groups, [page_bytes], [group_size])


def shared_layout_candidates(classes: list[LayerClass], options: PlanOptions) -> list[LayoutDraft]:
    """Every (page size, group size) pair worth planning; the caller keeps the best."""
    max_state = _max_state_page(classes, options)
    attention = _attention(classes)
    main_attn = _main_attention(classes)
    if options.block_size is not None:
        if main_attn is None:
            pages = [max_state]
        else:
            page = options.block_size * main_attn.bytes_per_token()
            if page < max_state:
                need = cdiv(max_state, main_attn.bytes_per_token())
                raise PlanError(
                    f"layout shared: block size {options.block_size} gives the "
                    f"{main_attn.model} attention layers a page of {page} bytes, smaller than "
                    f"the largest state page ({max_state} bytes); use --block-size >= "
                    f"{round_up(need, options.block_align_tokens)} or --layout split"
                )
            pages = [page]
    else:
        pages = [max_state] if max_state else []
        for cls in attention:
            per_token = cls.bytes_per_token()
            block = round_up(max(cdiv(max_state, per_token), 1), options.block_align_tokens)
            pages.append(block * per_token)
    drafts = []
    for page in sorted(set(pages)):
        for group_size in group_size_candidates(classes):
            draft = _shared_for_page(classes, options, page, group_size)
            if draft is None:
                continue
            if options.block_size is not None and main_attn is not None:
                main_blocks = {g.block_size for g in draft.groups if g.cls is main_attn}
                if main_blocks != {options.block_size}:
                    continue  # user block not a multiple of 16: cannot be honoured exactly
            drafts.append(draft)
    if options.block_size is None and options.packing == "any":
        drafts += slab_layout_candidates(classes, options)
    if options.max_block_size is not None:
        drafts = [
            d
            for d in drafts
            if max((g.block_size for g in d.groups if not g.cls.is_state), default=0)
            <= options.max_block_size
        ]
        if not drafts:
            raise PlanError(
                f"layout shared: no page or slab size keeps attention blocks within "
                f"--max-block-size {options.max_block_size} (largest state page "
                f"{max_state} bytes); raise it, or use --layout split (16-token blocks)"
            )
    if options.one_group_models:
        drafts = [d for d in drafts if _keeps_one_group(d, options)]
    few = [d for d in drafts if len(d.groups) <= MAX_GROUPS]
    drafts = few or sorted(drafts, key=lambda d: len(d.groups))[:1]
    if not drafts:
        raise PlanError(
            "layout shared: no page size fits every layer class "
            f"(largest state page {max_state} bytes, attention bytes/token "
            f"{[c.bytes_per_token() for c in attention]}); "
            "use a block size that is a multiple of 16, or --layout split"
        )
    return drafts


def _keeps_one_group(draft: LayoutDraft, options: PlanOptions) -> bool:
    """No class of a `PlanOptions.one_group_models` model is cut into several groups."""
    counts: dict[int, int] = {}
    for group in draft.groups:
        if group.cls.model in options.one_group_models:
            counts[id(group.cls)] = counts.get(id(group.cls), 0) + 1
    return all(n == 1 for n in counts.values())


def _divisors(count: int) -> list[int]:
    return [n for n in range(1, count + 1) if count % n == 0]


def _group_sizes(cls: LayerClass, options: PlanOptions) -> list[int]:
    """Layers per group a class may be cut into: any divisor of its layer count, or
    all of them when its model must keep one group (`PlanOptions.one_group_models`)."""
    count = len(cls.layers)
    return [count] if cls.model in options.one_group_models else _divisors(count)


def _best_attention_fit(
    per_token: int, sizes: list[int], slab: int, max_block: int | None, align: int
) -> tuple[int, int] | None:
    """(layers per group, block size) filling ``slab`` best; on equal fill, the
    smallest block. None when no group size in ``sizes`` leaves a 16-token block
    (within ``max_block`` when given)."""
    best: tuple[float, int, int] | None = None
    for n in sizes:
        block = (slab // (n * per_token)) // align * align
        if block == 0 or (max_block is not None and block > max_block):
            continue
        fill = n * block * per_token / slab
        if best is None or (fill, -block) > (best[0], -best[2]):
            best = (fill, n, block)
    return None if best is None else (best[1], best[2])


def _slab_for(classes: list[LayerClass], options: PlanOptions, slab: int) -> LayoutDraft | None:
    """Pack every class into slabs of ``slab`` bytes, layers side by side; None when an
    attention class cannot get a 16-token block or a state class does not fit."""
    attention: dict[int, tuple[int, int]] = {}
    for index, cls in enumerate(classes):
        if not cls.is_state:
            fit = _best_attention_fit(
                cls.bytes_per_token(),
                _group_sizes(cls, options),
                slab,
                options.max_block_size,
                options.block_align_tokens,
            )
            if fit is None:
                return None
            attention[index] = fit
    blocks = [block for _, block in attention.values()]
    interval = _state_interval(blocks, fallback=options.block_size or 256)
    if blocks and interval > MAX_HIT_GRANULARITY_FACTOR * max(blocks):
        return None
    groups: list[GroupDraft] = []
    for index, cls in enumerate(classes):
        if cls.is_state:
            raw = cls.state_page_bytes(options.num_spec_states)
            page = round_up(raw, SLAB_ALIGN_BYTES)
            fitting = [n for n in _group_sizes(cls, options) if n * page <= slab]
            if not fitting:
                return None
            per_group, block = max(fitting), interval
            padded = slab // per_group // SLAB_ALIGN_BYTES * SLAB_ALIGN_BYTES
        else:
            per_group, block = attention[index]
            raw = padded = block * cls.bytes_per_token()
        groups.extend(
            GroupDraft(cls, chunk, block, raw, padded, 0) for chunk in cls.chunks(per_group)
        )
    return LayoutDraft("shared", groups, [slab], [1], packing="slab")


def slab_layout_candidates(classes: list[LayerClass], options: PlanOptions) -> list[LayoutDraft]:
    """Shared pools whose slab is a whole number of one state class's pages: attention
    groups take as many layers as fill the slab best, which keeps their blocks small
    (hundreds of tokens instead of thousands) at a little padding."""
    slabs = {
        n * round_up(cls.state_page_bytes(options.num_spec_states), SLAB_ALIGN_BYTES)
        for cls in _states(classes)
        for n in _divisors(len(cls.layers))
    }
    drafts = [_slab_for(classes, options, slab) for slab in sorted(slabs)]
    return [d for d in drafts if d is not None]


# --------------------------------------------------------------------------- split


def split_layout(classes: list[LayerClass], options: PlanOptions) -> LayoutDraft:
    """One pool per class with natural pages: attention blocks of 16 tokens (or the
    user's block size), state pages of exactly the state size, no padding. State
    checkpoints (align mode) every smallest multiple of the attention block whose
    attention page holds the state page: the same hit granularity as vLLM's rule."""
    block = options.block_size or options.block_align_tokens
    max_state = _max_state_page(classes, options)
    main_attn = _main_attention(classes)
    if main_attn is not None:
        interval = round_up(max(cdiv(max_state, main_attn.bytes_per_token()), 1), block)
    else:
        interval = block if options.block_size else SPLIT_STATE_INTERVAL_NO_ATTENTION
    groups: list[GroupDraft] = []
    page_sizes: list[int] = []
    tensors: list[int] = []
    for pool, cls in enumerate(classes):
        if cls.is_state:
            raw = cls.state_page_bytes(options.num_spec_states)
            groups.append(GroupDraft(cls, cls.layers, interval, raw, raw, pool))
        else:
            raw = block * cls.bytes_per_token()
            groups.append(GroupDraft(cls, cls.layers, block, raw, raw, pool))
        page_sizes.append(raw)
        tensors.append(len(cls.layers))
    return LayoutDraft("split", groups, page_sizes, tensors)


def split_prefill_reserve_blocks(
    spec: SlidingWindowSpec | ChunkedLocalSpec,
    block_size: int,
    options: PlanOptions,
    num_requests: int,
    target: int,
) -> int:
    """Extra blocks a split-layout window pool holds beyond ``num_requests`` requests'
    decode-time blocks, so one step's prefill chunks fit.

    A windowed request with ``t`` tokens in flight holds ``max_live_blocks(bs, t + K)``
    blocks; decode sizing counts ``t = 1``. Since ``cdiv(a + b, bs) <= cdiv(a, bs) +
    cdiv(b, bs)``, any split of one step's ``max_num_batched_tokens`` (capped at the
    target length) among the ``num_requests`` requests needs at most
    ``cdiv(chunk, bs) + num_requests`` more blocks than their decode sizing. Without
    this, gpt-oss-120b's sliding pool fit 8 decoding requests and none could prefill an
    8,192-token chunk.
    """
    chunk = min(options.max_num_batched_tokens, target)
    k = options.num_spec_tokens
    grow = spec.max_live_blocks(block_size, chunk + k) - spec.max_live_blocks(block_size, 1 + k)
    return cdiv(chunk, block_size) + num_requests if grow > 0 else 0


# --------------------------------------------------------------------------- vllm


def vllm_layout(classes: list[LayerClass], options: PlanOptions) -> LayoutDraft:
    """vLLM 0.33's rule, reproduced from its documented behaviour.

    1. Attention block = smallest multiple of 16 tokens whose page (main model's
       attention layer) holds the main model's largest state page; a larger user block
       size is kept, a smaller one is raised by vLLM (we refuse it instead, with the
       number vLLM would use).
    2. Every page is brought to the largest page of all layers, draft included: a state
       page is padded; an attention page that divides the largest has its block size
       multiplied; any other attention page is padded; an MLA page that does not divide
       is refused (vLLM raises).
    3. Layers with one spec form a type, across main and draft (an MTP head shaped
       like the main attention layers joins them); group size is `vllm_group_size`; one
       pool, ``num_blocks = memory // (page * group_size)``.
    """
    classes = merge_equal_specs(classes)
    main_state = max(
        (c.state_page_bytes(options.num_spec_states) for c in _states(classes) if c.has_main),
        default=0,
    )
    main_attn = _main_attention([c for c in classes if c.has_main])
    align = options.block_align_tokens
    block = options.block_size or align
    if main_state and main_attn is not None:
        need = round_up(cdiv(main_state, main_attn.bytes_per_token()), align)
        if options.block_size is not None and options.block_size < need:
            raise PlanError(
                f"layout vllm: block size {options.block_size} is below the {need} tokens "
                f"vLLM derives so that one main attention page "
                f"({main_attn.bytes_per_token()} bytes/token) holds a state page "
                f"({main_state} bytes); vLLM would silently raise it to {need}; use "
                f"--block-size {need} or leave it unset"
            )
        block = max(block, need)
    pages = [
        c.state_page_bytes(options.num_spec_states) if c.is_state else block * c.bytes_per_token()
        for c in classes
    ]
    largest = max(pages)
    drafts: list[tuple[LayerClass, int, int]] = []  # class, block size, raw page
    for cls, page in zip(classes, pages, strict=True):
        if cls.is_state:
            drafts.append((cls, block, page))
        elif largest % page == 0:
            drafts.append((cls, block * (largest // page), largest))
        elif isinstance(cls.spec, MLASpec):
            raise PlanError(
                f"layout vllm: the {cls.model} MLA page ({page} bytes at block {block}) does "
                f"not divide the largest page ({largest} bytes); vLLM raises here; use "
                "--layout shared or split"
            )
        else:
            drafts.append((cls, block, page))
    group_size = vllm_group_size(classes)
    groups = [
        GroupDraft(cls, chunk, size, raw, largest, 0)
        for cls, size, raw in drafts
        for chunk in cls.chunks(group_size)
    ]
    return LayoutDraft("vllm", groups, [largest], [group_size])

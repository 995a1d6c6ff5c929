"""`plan()`: validate inputs, run the layouts, pick the best, explain the choice."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from hybridkv.errors import PlanError
from hybridkv.plan.capacity import build_plan
from hybridkv.plan.grouping import LayerClass, layer_classes, merge_equal_specs
from hybridkv.plan.layouts import (
    LayoutDraft,
    shared_layout_candidates,
    split_layout,
    vllm_layout,
)
from hybridkv.plan.types import (
    LAYOUTS,
    PACKINGS,
    SPEC_METHODS,
    STATE_MODES,
    CachePlan,
    PlanOptions,
    check_num_spec_tokens,
)
from hybridkv.spec.model import ModelSpec

HEAD_METHODS = ("mtp", "eagle")  # drafters whose layers ride on the main model's positions
DEFAULT_MAX_MODEL_LEN = 32768  # when the config states no max_position_embeddings
DEFAULT_TYPICAL_LEN = 8192
PADDING_WARN_FRACTION = 0.02
GRANULARITY_WARN_TOKENS = 64
TIE_TOLERANCE = 0.05  # concurrency at the target within 5% of the best counts as a tie
TYPICAL_TOLERANCE = 0.02
WASTE_TOLERANCE = 0.005  # of the budget
LAYOUT_PREFERENCE = ("shared", "split", "vllm")  # on equal scores: dynamic pools first


def _validate(options: PlanOptions, draft: ModelSpec | None) -> None:
    def bad(field: str, value: object, rule: str) -> PlanError:
        return PlanError(f"{field}={value!r}: {rule}")

    if options.layout not in LAYOUTS:
        raise bad("layout", options.layout, f"use one of {', '.join(LAYOUTS)}")
    if options.spec_method is not None and options.spec_method not in SPEC_METHODS:
        raise bad("spec_method", options.spec_method, f"use one of {', '.join(SPEC_METHODS)}")
    if options.state_mode is not None and options.state_mode not in STATE_MODES:
        raise bad("state_mode", options.state_mode, f"use one of {', '.join(STATE_MODES)}")
    check_num_spec_tokens(options.num_spec_tokens)
    if options.spec_method is None and options.num_spec_tokens:
        raise bad(
            "num_spec_tokens",
            options.num_spec_tokens,
            "needs a speculative method (--spec-method draft|eagle|mtp|ngram|suffix)",
        )
    if options.spec_method is not None and options.num_spec_tokens == 0:
        raise bad("num_spec_tokens", 0, f"spec method {options.spec_method!r} needs K >= 1")
    if options.spec_method == "draft" and draft is None:
        raise PlanError("spec_method='draft' needs a draft model (--draft MODEL)")
    if options.state_mode in ("align", "all") and not options.prefix_caching:
        raise bad("state_mode", options.state_mode, "only makes sense with prefix caching on")
    if options.packing not in PACKINGS:
        raise bad("packing", options.packing, f"use one of {', '.join(PACKINGS)}")
    for field in (
        "tp",
        "max_num_seqs",
        "max_num_batched_tokens",
        "memory_bytes",
        "block_align_tokens",
    ):
        value = getattr(options, field)
        if not isinstance(value, int) or value < 1:
            raise bad(field, value, "must be a positive integer")
    for field in ("max_model_len", "block_size", "max_block_size", "target_len", "typical_len"):
        value = getattr(options, field)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise bad(field, value, "must be a positive integer")
    align = options.block_align_tokens
    if options.block_size is not None and options.block_size % align:
        # attention kernels read blocks in units of block_align_tokens (16 for the GPU
        # kernels): the shared layout cannot honour another size exactly, and split / vllm
        # would hand the kernels a block they cannot use; refused up front for all three
        lower, upper = options.block_size // align * align, -(-options.block_size // align) * align
        nearest = f"{lower} or {upper}" if lower else str(upper)
        raise bad(
            "block_size",
            options.block_size,
            f"attention blocks are whole multiples of {align} tokens (the attention "
            f"kernels' block unit, block_align_tokens={align}); use {nearest}",
        )


def _warnings(plan: CachePlan, main: ModelSpec, draft: ModelSpec | None) -> tuple[str, ...]:
    notes = list(plan.warnings)
    cap, opts = plan.capacity, plan.options
    if opts.prefix_caching and plan.hit_granularity_tokens > GRANULARITY_WARN_TOKENS:
        notes.append(
            f"prompts shorter than {plan.hit_granularity_tokens} tokens never hit the prefix "
            "cache (lcm of the groups' block sizes)"
        )
    if not cap.max_num_seqs_fits:
        notes.append(
            f"max_num_seqs={cap.max_num_seqs} exceeds the {cap.max_num_seqs_that_fit} requests "
            f"whose blocks and state slots fit; the largest value that fits is "
            f"{cap.max_num_seqs_that_fit}"
        )
    if plan.waste_fraction > PADDING_WARN_FRACTION:
        notes.append(
            f"padding wastes {plan.waste_fraction:.1%} of the budget ({plan.waste_bytes} bytes)"
        )
    if main.max_position_embeddings is not None and main.max_position_embeddings < (
        cap.max_model_len
    ):
        # a warning, not an error: rope scaling (YaRN) legitimately runs past the config's
        # positions, and the planner answers what-if questions; vLLM refuses it unless
        # VLLM_ALLOW_LONG_MAX_MODEL_LEN is set
        notes.append(
            f"max_model_len={cap.max_model_len} exceeds the {main.max_position_embeddings} "
            f"positions of {main.name!r} (max_position_embeddings); the model may not "
            "handle longer contexts without rope scaling"
        )
    if (
        draft is not None
        and draft.max_position_embeddings is not None
        and (draft.max_position_embeddings < cap.max_model_len)
    ):
        notes.append(
            f"draft {draft.name!r} supports {draft.max_position_embeddings} positions, fewer "
            f"than max_model_len={cap.max_model_len}"
        )
    return tuple(notes)


def _finish(
    draft_layout: LayoutDraft,
    options: PlanOptions,
    main: ModelSpec,
    draft: ModelSpec | None,
    lengths: tuple[int, int, int],
) -> CachePlan:
    max_len, target, typical = lengths
    plan = build_plan(
        draft_layout,
        options,
        main_name=main.name,
        draft_name=draft.name if draft else None,
        max_model_len=max_len,
        target=target,
        typical=typical,
    )
    return dataclasses.replace(plan, warnings=_warnings(plan, main, draft))


def _shared_candidates(classes: list[LayerClass], options: PlanOptions) -> list[LayoutDraft]:
    """Shared-pool candidates; an EAGLE / MTP head shaped like the main model's layers
    may also join their groups (one block table for both, as vLLM does), which spares
    it a group of one layer whose slab would hold thousands of tokens."""
    drafts = shared_layout_candidates(classes, options)
    merged = merge_equal_specs(classes)
    if options.spec_method in HEAD_METHODS and len(merged) < len(classes):
        with contextlib.suppress(PlanError):  # the unmerged candidates stand on their own
            drafts += shared_layout_candidates(merged, options)
    return drafts


def _plan_layout(
    name: str,
    classes: list[LayerClass],
    options: PlanOptions,
    main: ModelSpec,
    draft: ModelSpec | None,
    lengths: tuple[int, int, int],
) -> list[CachePlan]:
    """Every candidate plan of layout ``name`` (shared has several page / slab sizes)."""
    builders: dict[str, Callable[[], list[LayoutDraft]]] = {
        "shared": lambda: _shared_candidates(classes, options),
        "split": lambda: [split_layout(classes, options)],
        "vllm": lambda: [vllm_layout(classes, options)],
    }
    return [_finish(d, options, main, draft, lengths) for d in builders[name]()]


def plan(
    main: ModelSpec,
    draft: ModelSpec | None = None,
    options: PlanOptions | None = None,
    **option_values: object,
) -> CachePlan:
    """Plan cache memory for ``main`` (and an optional ``draft``).

    Options come as a `PlanOptions` or as keyword arguments of the same names. Every
    candidate of the asked layout(s) is planned (``auto``: all three) and `_pick`
    chooses among all of them; the best of each other layout is kept in
    ``alternatives``.
    Raises `PlanError` with the numbers when no layout can serve one request.
    """
    opts = options or PlanOptions()
    if option_values:
        opts = dataclasses.replace(opts, **option_values)  # type: ignore[arg-type]
    _validate(opts, draft)
    max_len = opts.max_model_len or main.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
    target = opts.target_len or max_len
    typical = opts.typical_len or min(DEFAULT_TYPICAL_LEN, max_len)
    lengths = (max_len, target, typical)
    classes = layer_classes(main, draft, opts)
    names = LAYOUT_PREFERENCE if opts.layout == "auto" else (opts.layout,)
    plans: list[CachePlan] = []
    errors: list[str] = []
    for name in names:
        try:
            plans.extend(_plan_layout(name, classes, opts, main, draft, lengths))
        except PlanError as err:
            if opts.layout != "auto":
                raise
            errors.append(f"{name}: {err}")
    if not plans:
        raise PlanError("no layout works: " + "; ".join(errors))
    best = _pick(plans)
    if best.capacity.max_concurrency == 0:
        raise _no_room(best, main)
    # the best of each other layout, for comparison
    others = tuple(
        _pick([p for p in plans if p.layout == name])
        for name in LAYOUT_PREFERENCE
        if name != best.layout and any(p.layout == name for p in plans)
    )
    reason = _reason(best, others, errors)
    note = _granularity_note(best, plans) if opts.layout == "auto" else None
    warnings = best.warnings + ((note,) if note else ())
    return dataclasses.replace(best, alternatives=others, reason=reason, warnings=warnings)


def _pick(plans: list[CachePlan]) -> CachePlan:
    """The best plan, by stages; each stage keeps the plans within its tolerance:

    1. never below vLLM's rule in concurrency at the target length, nor coarser in
       prefix-hit granularity with prefix caching on (a plan that would hold more
       requests with coarser hits is passed over, and the warnings say so with the
       numbers); then within `TIE_TOLERANCE` of the best concurrency left;
    2. concurrency at the typical length within `TYPICAL_TOLERANCE` of the best;
    3. padding within `WASTE_TOLERANCE` of the budget of the least;
    then the smallest largest attention block (prefix-hit granularity), the fewest
    groups (block tables per request), and shared > split > vllm.
    """
    kept = _never_worse_than_vllm(plans)
    top = max(p.capacity.max_concurrency for p in kept)
    kept = [p for p in kept if p.capacity.max_concurrency >= top * (1 - TIE_TOLERANCE)]
    best_typical = max(p.capacity.concurrency_at_typical for p in kept)
    kept = [
        p
        for p in kept
        if p.capacity.concurrency_at_typical >= best_typical * (1 - TYPICAL_TOLERANCE)
    ]
    least_waste = min(p.waste_fraction for p in kept)
    kept = [p for p in kept if p.waste_fraction <= least_waste + WASTE_TOLERANCE]
    return min(
        kept,
        key=lambda p: (
            max((g.block_size for g in p.groups if g.kind != "state"), default=0),
            len(p.groups),
            -p.capacity.max_concurrency,
            LAYOUT_PREFERENCE.index(p.layout),
        ),
    )


def _never_worse_than_vllm(plans: list[CachePlan]) -> list[CachePlan]:
    """The plans that hold at least as many requests as vLLM's rule and, with prefix
    caching on, take prefix hits no coarser than it (all plans when vLLM's rule is not
    among them). vLLM's own plan always passes, so the result is never empty."""
    vllm = [p for p in plans if p.layout == "vllm"]
    if not vllm:
        return plans
    floor = max(p.capacity.max_concurrency for p in vllm)
    granularity = min(p.hit_granularity_tokens for p in vllm)
    caching = vllm[0].options.prefix_caching
    return [
        p
        for p in plans
        if p.capacity.max_concurrency >= floor
        and (not caching or p.hit_granularity_tokens <= granularity)
    ]


def _granularity_note(best: CachePlan, plans: list[CachePlan]) -> str | None:
    """Why ``best`` holds fewer requests than a plan it passed over, when it does: the
    other plan's coarser prefix hits (numbers on both sides)."""
    if not best.options.prefix_caching:
        return None
    richer = [
        p
        for p in plans
        if p.capacity.max_concurrency > best.capacity.max_concurrency
        and p.hit_granularity_tokens > best.hit_granularity_tokens
    ]
    if not richer:
        return None
    other = max(richer, key=lambda p: p.capacity.max_concurrency)
    return (
        f"layout {best.layout} holds {best.capacity.max_concurrency} requests at "
        f"{best.capacity.target_len} tokens, {other.layout} would hold "
        f"{other.capacity.max_concurrency}, but its prefix hits come in steps of "
        f"{other.hit_granularity_tokens} tokens instead of {best.hit_granularity_tokens} "
        "(auto never takes a coarser hit granularity than vLLM's rule); pass "
        f"--layout {other.layout} to prefer concurrency"
    )


def _reason(best: CachePlan, others: tuple[CachePlan, ...], errors: list[str]) -> str:
    if not others and not errors:
        return f"layout {best.layout} requested"
    parts = [
        f"{best.layout}: {best.capacity.max_concurrency} requests at "
        f"{best.capacity.target_len} tokens, {best.waste_fraction:.2%} padding"
    ]
    parts += [
        f"{p.layout}: {p.capacity.max_concurrency} requests, {p.waste_fraction:.2%} padding"
        for p in others
    ]
    parts += [f"not possible: {e}" for e in errors]
    rule = (
        "highest concurrency at the target length (within 5%, never below vLLM's rule "
        "nor with coarser prefix hits), then at the typical length (within 2%), then "
        "least padding, smallest blocks, fewest groups; "
    )
    return rule + "; ".join(parts)


def _no_room(plan: CachePlan, main: ModelSpec) -> PlanError:
    need = sum(
        g.blocks_needed(plan.capacity.target_len, plan.options.num_spec_tokens)
        * plan.pools[g.pool_id].slab_bytes
        for g in plan.groups
    )
    return PlanError(
        f"memory {plan.memory_bytes} bytes cannot hold one request of "
        f"{plan.capacity.target_len} tokens for {main.name!r} (needs about {need} bytes in "
        f"layout {plan.layout}); raise --memory, lower --max-model-len, or use a smaller "
        "kv dtype"
    )

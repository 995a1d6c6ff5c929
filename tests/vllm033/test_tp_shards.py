"""The seed geometry per tensor-parallel shard through vLLM 0.33's own planning flow.

At TP 2 / 4 / 8 every worker builds its layers' KV-cache specs for its shard (vLLM's
`ModelConfig.get_num_kv_heads` and the model's state shapes divide heads over the
ranks; the main model's 2 KV heads are replicated at TP 4 and 8, one per rank), and
vLLM's engine core plans the merged specs with the KV-cache config builder, which the
plugin resolves to hybridkv's. hybridkv plans the same shard (`PlanOptions.tp`): in a
block-outermost layout its pages equal vLLM's layer by layer, nothing is padded, and
the pool vLLM sizes is the one hybridkv's plan gives. Where hybridkv's plan gains
nothing (TP 4: vLLM's own rule already pads 0.00% there) or cannot keep vLLM's state
checkpoint grid (TP 8 with prefix caching), vLLM's layout and grouping stay and the
log says why. Specs are built as in `test_seed_geometry` (vLLM's classes,
FlashAttention's kernel unit, no weights, no GPU).

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -m vllm tests/vllm033
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from tests.vllm033.test_seed_geometry import (
    KV_MEMORY_BYTES,
    MAX_MODEL_LEN,
    Seed,
    _draft_group_check,
    _hybridkv_log,
    _numbers,
    _plan_through_vllm,
    _with_hybridkv,
    build_seed,
)

pytestmark = pytest.mark.vllm

TP_SIZES = (2, 4, 8)
BLOCK_OUTERMOST = "BLNHC"


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, bool], Seed]:
    """shard(tp, prefix_caching): the seed at that TP, built once per pair."""
    built: dict[tuple[int, bool], Seed] = {}

    def get(tp: int, prefix_caching: bool) -> Seed:
        if (tp, prefix_caching) not in built:
            root = tmp_path_factory.mktemp(f"seed_tp{tp}")
            built[tp, prefix_caching] = build_seed(root, prefix_caching=prefix_caching, tp=tp)
        return built[tp, prefix_caching]

    return get


def _hybridkv_groups(
    seed: Seed, layout: str | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Any]:
    """(config, kv_config, hybridkv's choice) with the plugin's builder; the builder's
    reason is raised when it fell back to vLLM's grouping."""
    from hybridkv.vllm.builder import LAST_GROUPING, kernel_align_tokens, plan_groups

    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    config, kv_config = _plan_through_vllm(seed, layout, monkeypatch)
    if not LAST_GROUPING:
        plan_groups(config, dict(seed.specs), kernel_align_tokens(config))
    assert len(LAST_GROUPING) == 1
    return config, kv_config, LAST_GROUPING[0]


def _pages(seed: Seed, kind: str, draft: bool) -> set[int]:
    """vLLM's raw pages of one kind (state: per block; attention: per token)."""
    from hybridkv.vllm.builder import raw_page_bytes

    return {
        raw_page_bytes(s) // (1 if kind == "MambaSpec" else s.block_size)
        for n, s in seed.specs.items()
        if type(s).__name__ == kind and (n in seed.draft_names) == draft
    }


def test_vllm_shards_the_seed(shard: Callable[[int, bool], Seed]) -> None:
    """The premise: vLLM's per-rank pages shrink with TP (state and draft attention
    heads divided, the main model's 2 KV heads replicated past TP 2)."""
    (state_one,) = _pages(shard(1, True), "MambaSpec", False)
    (draft_one,) = _pages(shard(1, True), "FullAttentionSpec", True)
    assert _pages(shard(1, True), "FullAttentionSpec", False) == {1024}  # fp8, 2 x 256
    for tp in TP_SIZES:
        seed = shard(tp, True)
        assert _pages(seed, "MambaSpec", False) == {state_one // tp}
        assert _pages(seed, "FullAttentionSpec", True) == {draft_one // tp}
        assert _pages(seed, "FullAttentionSpec", False) == {512}


@pytest.mark.parametrize(
    ("tp", "prefix_caching"), [(2, True), (4, True), (2, False), (4, False), (8, False)]
)
def test_hybridkv_plans_each_shard(
    shard: Callable[[int, bool], Seed],
    tp: int,
    prefix_caching: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a block-outermost layout: hybridkv's pages are vLLM's for that rank, layer by
    layer; no padding; at least stock's requests; vLLM sizes hybridkv's pool; the draft
    in one group (vLLM 0.33's own check)."""
    from hybridkv.plan import plan
    from hybridkv.vllm.builder import iter_layer_specs, model_specs, raw_page_bytes

    seed = shard(tp, prefix_caching)
    stock_config, stock = _plan_through_vllm(seed, None, monkeypatch)
    stock_requests, stock_padding = _numbers(stock_config, stock)
    same_config, same_layout = _plan_through_vllm(seed, BLOCK_OUTERMOST, monkeypatch)
    same_requests, _ = _numbers(same_config, same_layout)
    config, kv_config, choice = _hybridkv_groups(seed, BLOCK_OUTERMOST, monkeypatch)
    requests, padding = _numbers(config, kv_config)
    print(
        f"seed TP {tp}, caching {prefix_caching}, 60 GiB per rank, 32K: vLLM 0.33 "
        f"{stock_requests:.2f} requests (its layout), {same_requests:.2f} ({BLOCK_OUTERMOST}), "
        f"padding {100 * stock_padding:.2f}%; with hybridkv {requests:.2f}, padding "
        f"{100 * padding:.2f}%; {choice.log_line(MAX_MODEL_LEN)}"
    )
    assert choice.plan.options.tp == tp
    assert padding == 0.0
    # against vLLM's grouping in the same layout (the plugin compares with vLLM's own
    # layout per engine: `test_default_layout_per_shard`). Where vLLM pads nothing
    # (TP 4: a rank's 560-token attention page equals its state page) hybridkv has
    # nothing to win, and its coarser 1680-token state checkpoints cost 0.4% at 32K.
    if stock_padding > 0:
        assert requests > same_requests
    else:
        assert requests >= 0.99 * same_requests
    ours: dict[str, tuple[int, int]] = {}
    for group in choice.plan.groups:
        names = kv_config.kv_cache_groups[group.group_id].layer_names
        for name in names:
            ours[name] = (group.page_bytes, group.block_size)
    assert sorted(ours) == sorted(seed.specs)
    for name, spec in seed.specs.items():  # vLLM's own per-layer specs for this rank
        page, block = ours[name]
        if type(spec).__name__ == "MambaSpec":
            assert page == raw_page_bytes(spec), name
        else:  # vLLM's rule chose another block: compare per token
            assert page == raw_page_bytes(spec) // spec.block_size * block, name
    for group in kv_config.kv_cache_groups:  # the specs vLLM hands the workers back
        for name, spec in zip(group.layer_names, iter_layer_specs(group), strict=True):
            assert raw_page_bytes(spec) == ours[name][0], name
    main, draft = model_specs(config, choice.plan.options.spec_method)
    same = plan(main, draft, dataclasses.replace(choice.plan.options, memory_bytes=KV_MEMORY_BYTES))
    assert kv_config.num_blocks == same.pools[0].num_pages
    _draft_group_check(kv_config, seed.draft_names)


@pytest.mark.parametrize(("tp", "expected"), [(2, "hybridkv"), (4, "either way"), (8, "grid")])
def test_default_layout_per_shard(
    shard: Callable[[int, bool], Seed], tp: int, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No layout set, prefix caching on: at TP 2 the workers offer a block-outermost
    layout first and hybridkv groups (as at TP 1); at TP 4 vLLM's rule already pads
    nothing (the 560-token attention page of a rank equals its state page), so vLLM's
    order stays; at TP 8 hybridkv's checkpoint interval is not a multiple of the
    288-token Mamba block every worker keeps, so vLLM's grouping stays. Each with one
    reason in the log."""
    from hybridkv.vllm.builder import LAST_GROUPING

    seed = shard(tp, True)
    stock_config, stock = _plan_through_vllm(seed, None, monkeypatch)
    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    with _hybridkv_log() as records:
        config, kv_config = _plan_through_vllm(seed, None, monkeypatch)
    messages = " | ".join(r.getMessage() for r in records)
    if expected == "hybridkv":
        assert config.cache_config.kv_cache_layout == BLOCK_OUTERMOST
        assert LAST_GROUPING and _numbers(config, kv_config)[1] == 0.0
        return
    assert not LAST_GROUPING
    assert kv_config.num_blocks == stock.num_blocks
    if expected == "either way":
        assert "requests per GiB in LBNHC either way" in messages, messages
        assert _numbers(stock_config, stock)[1] == 0.0
    else:
        assert "not a multiple of vLLM's Mamba block size 288" in messages, messages


@pytest.mark.parametrize("tp", TP_SIZES)
def test_plan_is_the_same_on_every_planning(
    shard: Callable[[int, bool], Seed], tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's specs are equal, so planning them again (a fresh config) gives the
    same groups, block sizes and pool."""
    from hybridkv.vllm.builder import LAST_GROUPING

    seed = shard(tp, tp != 8)
    _with_hybridkv(monkeypatch)
    runs = []
    for config in (seed.vllm_config, copy.deepcopy(seed.vllm_config)):
        LAST_GROUPING.clear()
        fresh = dataclasses.replace(seed, vllm_config=config)
        _, kv_config = _plan_through_vllm(fresh, BLOCK_OUTERMOST, monkeypatch)
        assert len(LAST_GROUPING) == 1
        runs.append((kv_config, LAST_GROUPING[0]))
    (kv_a, choice_a), (kv_b, choice_b) = runs
    assert choice_a.log_line(MAX_MODEL_LEN) == choice_b.log_line(MAX_MODEL_LEN)
    assert kv_a.num_blocks == kv_b.num_blocks
    assert [(g.layer_names, g.kv_cache_spec) for g in kv_a.kv_cache_groups] == [
        (g.layer_names, g.kv_cache_spec) for g in kv_b.kv_cache_groups
    ]


def test_unsharded_plan_disagrees_with_a_shard(
    shard: Callable[[int, bool], Seed], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What TP did before hybridkv planned shards: the whole model planned against a
    rank's specs is refused with both page sizes, and vLLM's grouping stays. (The
    draft's TP is set to 1 too, so the page check, not the TP check, answers.)"""
    from hybridkv.vllm.builder import LAST_GROUPING

    seed = shard(2, True)
    config = copy.deepcopy(seed.vllm_config)
    config.parallel_config.tensor_parallel_size = 1  # as if hybridkv ignored TP
    config.speculative_config.draft_tensor_parallel_size = 1
    _, stock = _plan_through_vllm(seed, BLOCK_OUTERMOST, monkeypatch)
    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    with _hybridkv_log() as records:
        unsharded = dataclasses.replace(seed, vllm_config=config)
        _, kv_config = _plan_through_vllm(unsharded, BLOCK_OUTERMOST, monkeypatch)
    assert not LAST_GROUPING
    assert kv_config.num_blocks == stock.num_blocks
    messages = " | ".join(r.getMessage() for r in records)
    assert "the specs disagree" in messages or "bytes per token" in messages, messages


def test_draft_at_another_tp_keeps_vllms_grouping(
    shard: Callable[[int, bool], Seed], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM allows a draft at TP 1 beside a TP-2 target; hybridkv plans one TP size for
    both, so it says so and leaves the grouping to vLLM."""
    from hybridkv.vllm.builder import LAST_GROUPING

    seed = shard(2, True)
    config = copy.deepcopy(seed.vllm_config)
    config.speculative_config.draft_tensor_parallel_size = 1
    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    with _hybridkv_log() as records:
        _plan_through_vllm(
            dataclasses.replace(seed, vllm_config=config), BLOCK_OUTERMOST, monkeypatch
        )
    assert not LAST_GROUPING
    messages = " | ".join(r.getMessage() for r in records)
    assert "the draft model runs at tensor-parallel size 1, the main model at 2" in messages

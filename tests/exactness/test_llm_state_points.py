"""State write points and planned tensor views.

Write points: one step stores the state after any prefix of a request's new tokens
(checkpoints inside a prefill chunk, the state after each speculative draft). Each
captured state must equal the state a separate run over exactly that prefix leaves.
Views: the planned pool bytes hold each layer at the placement's offset, and a plan
whose state shape disagrees with the model layer is rejected naming the layer."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.engine.forward.runner import state_write_points  # noqa: E402
from hybridkv.engine.forward.tensors import build_cache_tensors  # noqa: E402
from hybridkv.engine.ops.context import StateCache, StateSlots, make_batch  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402
from hybridkv.models.registry import load_model_spec  # noqa: E402
from hybridkv.plan.planner import plan  # noqa: E402
from hybridkv.plan.types import PlanOptions  # noqa: E402
from hybridkv.spec.dtypes import DType  # noqa: E402

F32 = DType.FLOAT32


def _mixer_and_cache(model, rows_extra=2, num_slots=12):
    """The first state layer of ``model`` and a NaN-filled cache with S extra conv rows."""
    index = next(i for i, b in enumerate(model.blocks) if b.desc and b.desc.kind == "state")
    block = model.blocks[index]
    desc = block.desc
    channels, rows = desc.shapes["conv"]
    cache = StateCache(
        conv=torch.full((num_slots, channels, rows + rows_extra), float("nan")),
        ssm=torch.full((num_slots, *desc.shapes["ssm"]), float("nan")),
        group="s",
    )
    mixer = getattr(block, "mixer", None) or getattr(block, "linear_attn", None) or block
    return mixer, cache, model.config["hidden_size"]


def _run(mixer, cache, x, computed, read, points):
    batch = make_batch(
        [(list(range(x.shape[0])), computed)],
        state_slots={"s": StateSlots.from_points([read], [points])},
    )
    batch.check()
    return mixer(x, batch, cache)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_write_points_equal_states_of_separate_prefix_runs(llm_case, name):
    from hybridkv.engine.models import load_model

    model = load_model(llm_case(name).folder)
    mixer, cache, hidden = _mixer_and_cache(model)
    torch.manual_seed(0)
    x = torch.randn(9, hidden)
    # Step from a stored state (slot 1, after 3 tokens): points after 0, 2, 5, 6 (the
    # "write" block), 7, 8 (two "drafts") and 9 new tokens, 0 and 6 into the read slot.
    _run(mixer, cache, torch.randn(3, hidden), 0, None, [(3, 1)])
    start_conv, start_ssm = cache.conv[1].clone(), cache.ssm[1].clone()
    points = [(0, 2), (2, 3), (5, 4), (6, 1), (7, 5), (8, 6), (9, 7)]
    out_all = _run(mixer, cache, x, 3, 1, points)
    for k, slot in points:
        cache.conv[10], cache.ssm[10] = start_conv, start_ssm
        if k:
            out_k = _run(mixer, cache, x[:k], 3, 10, [(k, 11)])
            torch.testing.assert_close(out_k, out_all[:k], rtol=1e-5, atol=1e-5)
        else:
            cache.conv[11], cache.ssm[11] = start_conv, start_ssm
        torch.testing.assert_close(cache.conv[slot], cache.conv[11], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.ssm[slot], cache.ssm[11], rtol=1e-5, atol=1e-5)
    # Conv rows keep the most recent inputs, oldest first: point 0 is the read state.
    torch.testing.assert_close(cache.conv[2], start_conv)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_no_read_slot_starts_from_zeros_not_old_contents(llm_case, name):
    from hybridkv.engine.models import load_model

    model = load_model(llm_case(name).folder)
    mixer, cache, hidden = _mixer_and_cache(model)
    x = torch.randn(4, hidden)
    out = _run(mixer, cache, x, 0, None, [(4, 0), (2, 3)])  # slots hold NaN
    assert torch.isfinite(out).all()
    assert torch.isfinite(cache.conv[0]).all() and torch.isfinite(cache.ssm[3]).all()


def test_state_write_points_from_manager_slots():
    # c = 10, write after 20 tokens, drafts after 21 and 22, checkpoint at 16.
    read, points = state_write_points(7, 8, 20, (3, 4), [(16, 9)], 10)
    assert read == 7
    assert points == [(10, 8), (11, 3), (12, 4), (6, 9)]
    assert state_write_points(None, 5, 4, (), None, 0) == (None, [(4, 5)])


def test_write_point_past_the_step_is_rejected():
    batch = make_batch([([1, 2], 0)], state_slots={"s": StateSlots.from_points([None], [[(3, 1)]])})
    with pytest.raises(EngineError, match=r"after 3 tokens.*2 new tokens"):
        batch.check()


def _plan(folder, **kw):
    options = PlanOptions(
        kv_dtype=F32, conv_dtype=F32, ssm_dtype=F32, memory_bytes=1 << 20, max_model_len=128, **kw
    )
    return plan(load_model_spec(folder), None, options)


@pytest.mark.parametrize("layout", ["shared", "split"])
def test_views_sit_at_the_planned_offsets(llm_case, layout):
    from hybridkv.engine.models import load_model

    folder = llm_case("qwen3_5").folder
    model = load_model(folder)
    p = _plan(folder, layout=layout)
    tensors = build_cache_tensors(p, model.layers, torch.float32)
    for place in p.tensors:
        cache = tensors.caches[model.layers[place.layer.index].index]
        pool = tensors.pools[place.pool_id]
        first = cache.key if hasattr(cache, "key") else cache.conv
        first[5].fill_(1.5)  # page 5 of this layer
        at = place.offset_bytes + 5 * place.page_stride_bytes
        assert pool[at : at + 4].view(torch.float32).item() == 1.5
        assert (pool.view(torch.float32) == 1.5).sum() == first[5].numel()
        pool.zero_()


def test_state_shape_mismatch_names_the_layer(llm_case):
    from hybridkv.engine.models import load_model

    folder = llm_case("qwen3_5").folder
    model = load_model(folder)
    p = _plan(folder, layout="split")
    state = next(g for g in p.groups if g.kind == "state")
    bad = dataclasses.replace(state.spec, conv_kernel=state.spec.conv_kernel + 1)
    groups = tuple(
        dataclasses.replace(g, spec=bad) if g.group_id == state.group_id else g for g in p.groups
    )
    with pytest.raises(EngineError, match=r"layer main\.0 .*conv"):
        build_cache_tensors(dataclasses.replace(p, groups=groups), model.layers, torch.float32)


def test_speculative_plan_keeps_extra_conv_rows(llm_case):
    from hybridkv.engine.models import load_model

    folder = llm_case("nemotron_h").folder
    model = load_model(folder)
    p = _plan(folder, spec_method="ngram", num_spec_tokens=3)
    tensors = build_cache_tensors(p, model.layers, torch.float32)
    conv = tensors.caches[0].conv
    assert conv.shape[1:] == (128, 3 + 3)  # kernel - 1 + S rows

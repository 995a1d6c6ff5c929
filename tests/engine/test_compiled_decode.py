"""The opt-in compiled decode cores (`hybridkv.engine.ops.compiled_decode`): when they apply,
their row buckets, and (slow: they compile) the Gated DeltaNet core against a float64
composition of the eager path's own pieces, padded buckets included, and inside the
engine on a tiny Qwen3-Next."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from hybridkv.engine.ops import compiled, compiled_decode, delta_rule  # noqa: E402
from hybridkv.engine.ops.context import StateCache, StateSlots, make_batch  # noqa: E402
from hybridkv.engine.ops.state_batched import causal_conv_grid, state_parts  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402


@pytest.fixture
def switched_on():
    was = compiled.enabled()
    compiled.enable()
    try:
        yield
    finally:
        compiled.enable(was)


def test_applies_only_to_reduced_precision_cpu_steps(switched_on):
    last = compiled_decode.ROW_BUCKETS[-1]
    assert compiled_decode.applies(torch.zeros(1, 8, dtype=torch.bfloat16))
    assert compiled_decode.applies(torch.zeros(last, 8, dtype=torch.float16))
    assert not compiled_decode.applies(torch.zeros(last + 1, 8, dtype=torch.bfloat16))
    assert not compiled_decode.applies(torch.zeros(4, 8))  # float32: the exactness contract
    compiled.enable(False)
    assert not compiled_decode.applies(torch.zeros(4, 8, dtype=torch.bfloat16))


def test_buckets():
    assert [compiled_decode.bucket(r) for r in (1, 2, 3, 5, 9, 17, 25, 33, 64)] == [
        1,
        2,
        4,
        8,
        16,
        24,
        32,
        48,
        64,
    ]
    assert compiled_decode.bucket(65) is None
    assert list(compiled_decode.ROW_BUCKETS) == sorted(set(compiled_decode.ROW_BUCKETS))


def _inputs(rows: int, seed: int, extra_conv_rows: int = 0) -> dict[str, object]:
    """A GDN layer's decode inputs: 2 key heads of 16, 4 value heads of 8, kernel 4,
    states in bf16 buffers of 40 slots (slot 0 the null slot), rows on slots 3, 6, 9, ...;
    conv windows of 3 + ``extra_conv_rows`` columns (a plan keeps more for speculative
    tokens; the conv reads the last 3)."""
    gen = torch.Generator().manual_seed(seed)
    nk, dk, nv, dv, kernel = 2, 16, 4, 8, 4
    conv_dim = 2 * nk * dk + nv * dv

    def bf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    return {
        "mixed": bf(rows, conv_dim),
        "z": bf(rows, nv * dv),
        "b": bf(rows, nv),
        "a": bf(rows, nv),
        "a_log": bf(nv, scale=0.5),
        "dt_bias": bf(nv, scale=0.5),
        "conv_state": bf(rows, conv_dim, kernel - 1 + extra_conv_rows),
        "ssm_buffer": bf(40, nv, dv, dk, scale=0.3),
        "slots": torch.arange(rows) * 3 + 3,
        "taps": bf(conv_dim, kernel, scale=0.5),
        "norm_weight": bf(dv),
        "eps": 1e-6,
        "num_k_heads": nk,
        "head_k_dim": dk,
    }


def _reference(inp: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager layer's own pieces (`GatedDeltaNet.forward`, `causal_conv_grid`,
    `delta_rule.prepare_grouped`, `delta_rule_decode_`, the gated norm), in float64:
    the core, and the rows' new conv and ssm states."""
    d = torch.float64
    slots = inp["slots"]
    nk, dk = inp["num_k_heads"], inp["head_k_dim"]
    ssm = inp["ssm_buffer"][slots].to(d)
    rows, nv, dv, _ = ssm.shape
    beta = torch.sigmoid(inp["b"].to(d))
    g = -inp["a_log"].to(d).exp() * F.softplus(inp["a"].to(d) + inp["dt_bias"].to(d))
    conv, history = causal_conv_grid(
        inp["mixed"].to(d)[:, None],
        inp["conv_state"].to(d),
        inp["taps"].to(d),
        None,
    )
    conv = F.silu(conv)
    q, k, v = torch.split(conv, [nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v, g_, beta_ = delta_rule.prepare_grouped(
        q.reshape(rows, 1, nk, dk),
        k.reshape(rows, 1, nk, dk),
        v.reshape(rows, 1, nv, dv),
        g[:, None],
        beta[:, None],
        nv // nk,
    )
    q, k, v, g_, beta_ = (x.to(d) for x in (q, k, v, g_, beta_))
    out = delta_rule.delta_rule_decode_(q, k, v, g_, beta_, ssm)[:, 0]  # [R, Hv, dv]
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + inp["eps"])
    gate = inp["z"].to(d).view(rows, nv, dv)
    gated = inp["norm_weight"].to(d) * normed * F.silu(gate)
    return gated.reshape(rows, nv * dv), history[:, :, 1:], ssm


@pytest.mark.slow
@pytest.mark.parametrize(("rows", "extra_conv_rows"), [(1, 0), (3, 0), (8, 0), (3, 1)])
def test_gdn_decode_matches_the_eager_pieces(switched_on, rows, extra_conv_rows):
    """Compiled bf16 against float64: outputs within bf16 rounding of the chain (each
    bf16 store is 2^-8 relative); the new ssm states land at the rows' slots and
    nowhere else but the null slot 0 (3 rows run in the 4-row bucket, the padding row
    on slot 0)."""
    inp = _inputs(rows, seed=rows, extra_conv_rows=extra_conv_rows)
    want = _reference(inp)
    ssm_before = inp["ssm_buffer"].clone()
    normed, conv_new = compiled_decode.gdn_decode(**inp)
    assert normed.dtype == conv_new.dtype == torch.bfloat16 and normed.shape == want[0].shape
    torch.testing.assert_close(normed.double(), want[0], rtol=4e-2, atol=4e-2)
    assert torch.equal(conv_new, want[1].to(torch.bfloat16))  # a shift of the stored values
    slots, ssm_after = inp["slots"], inp["ssm_buffer"]
    torch.testing.assert_close(ssm_after[slots].double(), want[2], rtol=2e-2, atol=1e-2)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    untouched[compiled_decode.NULL_SLOT] = False
    assert torch.equal(ssm_after[untouched], ssm_before[untouched])
    if compiled_decode.bucket(rows) == rows:  # no padding row: slot 0 untouched too
        assert torch.equal(ssm_after[0], ssm_before[0])


@pytest.mark.slow
def test_padded_bucket_rows_equal_their_own_bucket(switched_on):
    """Rows do not mix: 3 rows padded to the 4-row bucket give the 4-row call's
    outputs and stores when the 4th row is the padding (null slot, zero inputs)."""
    inp = _inputs(3, seed=11)
    four = dict(inp)
    for name in ("mixed", "z", "b", "a", "conv_state"):
        x = inp[name]
        four[name] = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    four["slots"] = torch.cat([inp["slots"], inp["slots"].new_zeros(1)])
    four["ssm_buffer"] = inp["ssm_buffer"].clone()
    got = compiled_decode.gdn_decode(**inp)
    want = compiled_decode.gdn_decode(**four)
    assert torch.equal(got[0], want[0][:3]) and torch.equal(got[1], want[1][:3])
    assert torch.equal(inp["ssm_buffer"], four["ssm_buffer"])


def test_fragmented_slots_take_the_compiled_core(switched_on, monkeypatch):
    """Decode rows on slots in more runs than `state_batched.MAX_SLOT_RUNS` (a server
    whose requests came and went) still take the compiled core (the ssm states are
    updated in place inside the graph; the conv windows, 3 + 1 columns here, go back in
    one scatter): outputs within bf16 rounding of the eager bf16 path, conv windows
    equal, ssm states close, every other slot untouched."""
    from tests.exactness.test_batched_kernels import gdn_layer

    slots = [9, 7, 5, 3, 1, 12, 20]  # one-row runs: more than MAX_SLOT_RUNS
    gen = torch.Generator().manual_seed(3)
    layer = gdn_layer(torch.Generator().manual_seed(3), torch.bfloat16)
    conv = torch.full((24, layer.shape.conv_dim, 3 + 1), float("nan"), dtype=torch.bfloat16)
    ssm = torch.full((24, 4, 4, 8), float("nan"), dtype=torch.bfloat16)
    for slot in slots:
        conv[slot] = torch.randn(conv.shape[1:], generator=gen).to(torch.bfloat16)
        ssm[slot] = (torch.randn(ssm.shape[1:], generator=gen) * 0.3).to(torch.bfloat16)
    batch = make_batch(
        [([1], 5 + r) for r in range(len(slots))],
        state_slots={"s": StateSlots.from_points(slots, [[(1, s)] for s in slots])},
    )
    (part,) = state_parts(batch, "s")
    assert part.slot_runs is None and part.in_place  # the path under test
    x = torch.randn(len(slots), 16, generator=gen).to(torch.bfloat16)
    calls = []
    real = compiled_decode.gdn_decode
    monkeypatch.setattr(
        compiled_decode, "gdn_decode", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    fast = StateCache(conv.clone(), ssm.clone(), "s")
    got = layer.forward(x, batch, fast, batched=True)
    assert calls == [1]
    compiled.enable(False)
    eager = StateCache(conv.clone(), ssm.clone(), "s")
    want = layer.forward(x, batch, eager, batched=True)
    assert calls == [1]  # the eager run did not take it
    torch.testing.assert_close(got.float(), want.float(), rtol=4e-2, atol=4e-2)
    assert torch.equal(fast.conv[slots], eager.conv[slots])
    torch.testing.assert_close(
        fast.ssm[slots].float(), eager.ssm[slots].float(), rtol=2e-2, atol=1e-2
    )
    others = [s for s in range(24) if s not in slots]
    assert fast.conv[others].isnan().all() and fast.ssm[others].isnan().all()
    assert not torch.equal(fast.ssm[slots].float(), ssm[slots].float())  # states moved


def test_too_many_rows_is_a_typed_error(switched_on):
    inp = _inputs(compiled_decode.ROW_BUCKETS[-1] + 1, seed=1)
    inp["slots"] = torch.arange(compiled_decode.ROW_BUCKETS[-1] + 1) % 39 + 1
    with pytest.raises(EngineError, match="decode rows"):
        compiled_decode.gdn_decode(**inp)


@pytest.mark.slow
def test_engine_takes_the_compiled_decode_core(tmp_path, monkeypatch):
    """On a tiny Qwen3-Next in bf16 with ``torch_compile=True`` every decode step's
    Gated DeltaNet layers go through `gdn_decode`, and the generated tokens of that run
    match an eager run's for the leading tokens (bf16 with different roundings: the
    random-weight model's logits are close, so only the first tokens are compared)."""
    pytest.importorskip("transformers")
    from hybridkv.engine import LLM
    from hybridkv.vllm.tiny_models import write_tiny_qwen3_next

    folder = write_tiny_qwen3_next(tmp_path / "m")
    calls: list[int] = []
    real = compiled_decode.gdn_decode

    def counted(*args: object, **kwargs: object):
        calls.append(args[0].shape[0])  # type: ignore[union-attr]
        return real(*args, **kwargs)

    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    options = {"dtype": "bfloat16", "memory_bytes": 64 << 20, "max_model_len": 64}
    was = compiled.enabled()
    try:
        eager = LLM(folder, **options).generate(prompts, max_new_tokens=3, ignore_eos=True)
        monkeypatch.setattr(compiled_decode, "gdn_decode", counted)
        llm = LLM(folder, torch_compile=True, **options)
        got = llm.generate(prompts, max_new_tokens=3, ignore_eos=True)
    finally:
        compiled.enable(was)
    num_gdn = sum(1 for d in llm.model.layers if d.family == "gated_delta_net")
    assert calls and set(calls) <= {1, 2} and len(calls) % num_gdn == 0
    assert [r.token_ids[:1] for r in got] == [r.token_ids[:1] for r in eager]

"""fp8 KV quantisation: saturation instead of NaN, per-tensor scales, the float32
simulation giving exactly the bits the fp8 pages give, typed errors for bad scales."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.ops import kv_quant  # noqa: E402
from hybridkv.engine.ops.kv_quant import KVQuant  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("dtype", FP8)
def test_out_of_range_values_saturate_not_nan(dtype):
    limit = torch.finfo(dtype).max
    x = torch.tensor([1e6, -1e6, 3.0, 0.0])
    q = kv_quant.quantize(x, dtype, 1.0).float()
    assert q.tolist() == [limit, -limit, 3.0, 0.0]


def test_e5m2_plain_cast_overflows_which_is_why_we_clamp():
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.03, 7.5])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_simulated_pages_read_back_the_fp8_bits(dtype, scale, act):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 2, 8, generator=gen) * 40).to(act)
    index = (torch.tensor([0, 0, 1, 1, 2, 3]), torch.tensor([0, 3, 1, 2, 0, 3]))
    real = torch.zeros(4, 4, 2, 8, dtype=dtype)
    sim = torch.full((4, 4, 2, 8), float("nan"))
    quant = KVQuant(dtype, scale, scale)
    kv_quant.store(real, index, x, quant)
    kv_quant.store(sim, index, x, KVQuant(dtype, scale, scale, simulate=True))
    got = kv_quant.load(real, index, act, quant)
    want = kv_quant.load(sim, index, act, KVQuant(dtype, scale, scale, simulate=True))
    assert torch.equal(got, want)
    assert got.dtype == act
    assert not torch.equal(got, x)  # rounding happened
    in_range = x.float().abs() < torch.finfo(dtype).max * scale * 0.9
    err = (got.float() - x.float()).abs() / x.float().abs().clamp_min(1e-2)
    assert err[in_range].max() < 0.3  # fp8 keeps 2-3 mantissa bits: coarse, not garbage
    saturated = got.float()[~in_range].abs()  # clamped to the fp8 max, times the scale
    assert (saturated <= torch.finfo(dtype).max * scale * 1.01).all()


def test_value_scale_is_used_for_values():
    x = torch.full((1, 1, 4), 2.0)
    pages = torch.zeros(1, 1, 1, 4, dtype=torch.float8_e4m3fn)
    index = (torch.tensor([0]), torch.tensor([0]))
    quant = KVQuant(torch.float8_e4m3fn, key_scale=1.0, value_scale=4.0)
    kv_quant.store(pages, index, x, quant, value=True)
    assert pages.float().flatten().tolist() == [0.5] * 4  # stored as 2 / 4
    assert (
        kv_quant.load(pages, index, torch.float32, quant, value=True).flatten().tolist()
        == [2.0] * 4
    )


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scales_are_typed_errors(scale):
    with pytest.raises(EngineError, match="positive finite"):
        KVQuant(torch.float8_e4m3fn, key_scale=scale)


def test_non_fp8_dtype_is_refused():
    with pytest.raises(EngineError, match="not an fp8 dtype"):
        KVQuant(torch.bfloat16)

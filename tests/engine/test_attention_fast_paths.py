"""Attention without a window loads K/V by whole blocks (`kv_io.load_kv_blocks`): the
same outputs, bit for bit, as the load by (block, offset) it replaces.

Unused cells of the pages hold NaN (float32) or NaN byte patterns (fp8), so a stale cell
past a row's last key that reached the softmax would show up as NaN; the block load
zeroes those cells, which the mask hides either way.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.ops.attention import attention_index, paged_attention  # noqa: E402
from hybridkv.engine.ops.context import KVCache  # noqa: E402
from hybridkv.engine.ops.kv_quant import KVQuant  # noqa: E402
from tests.exactness.test_batched_kernels import attention_case  # noqa: E402


def token_path(batch, group: str) -> None:
    """Memoise the step's attention index with the block load switched off."""
    index = attention_index(batch, group, None)
    parts = tuple(dataclasses.replace(p, key_blocks=None, pad_keys=None) for p in index.parts)
    batch.memo[("attention", group, None)] = dataclasses.replace(index, parts=parts)


def fresh(case_seed: int, block_size: int):
    return attention_case(case_seed, None, block_size)


@pytest.mark.parametrize("seed", range(10))
def test_block_load_equals_token_load_bit_for_bit(seed):
    block_size = [1, 4, 16][seed % 3]
    batch, cache, q, k, v, _ = fresh(seed, block_size)
    index = attention_index(batch, "g", None)
    assert all(p.key_blocks is not None for p in index.parts)  # the path under test
    plain_batch, plain_cache, *_ = fresh(seed, block_size)
    token_path(plain_batch, "g")
    got = paged_attention(q, k, v, cache, batch, scale=0.3)
    want = paged_attention(q, k, v, plain_cache, plain_batch, scale=0.3)
    assert not got.isnan().any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_block_load_of_fp8_pages_drops_nan_bytes_past_the_last_key(seed):
    """fp8 pages: every never-written cell holds 0xFF (NaN in e4m3); outputs equal the
    token load's and hold no NaN."""
    batch, cache, q, k, v, _ = fresh(seed, 4)
    quant = KVQuant(torch.float8_e4m3fn, key_scale=0.5, value_scale=2.0)

    def fp8_cache(c: KVCache) -> KVCache:
        key, value = (
            torch.where(t.isnan(), 0.0, t).to(torch.float8_e4m3fn) for t in (c.key, c.value)
        )
        nan = torch.tensor([0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
        key.view(torch.uint8)[c.key.isnan()] = 0xFF
        value.view(torch.uint8)[c.value.isnan()] = 0xFF
        assert key.float().isnan().any() and nan.float().isnan().all()
        return KVCache(key, value, "g", quant)

    plain_batch, plain_cache, *_ = fresh(seed, 4)
    token_path(plain_batch, "g")
    got = paged_attention(q, k, v, fp8_cache(cache), batch, scale=0.3)
    want = paged_attention(q, k, v, fp8_cache(plain_cache), plain_batch, scale=0.3)
    assert not got.isnan().any()
    assert torch.equal(got, want)

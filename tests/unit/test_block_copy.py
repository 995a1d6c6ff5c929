"""`engine.forward.block_copy.run_copies`: K/V slots [0, n) of every layer of the order's group
(main and draft views), bit for bit (fp8 pages included), nothing else touched."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.cache.junction import CopyOrder  # noqa: E402
from hybridkv.engine.forward.block_copy import run_copies  # noqa: E402
from hybridkv.engine.forward.tensors import CacheTensors, group_key  # noqa: E402
from hybridkv.engine.ops.context import KVCache  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402


def _kv(group: int, dtype: torch.dtype, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(6, 4, 2, 8, generator=g).to(dtype)  # [blocks, block 4, heads, dim]
    value = torch.randn(6, 4, 2, 8, generator=g).to(dtype)
    return KVCache(key=key, value=value, group=group_key(group))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_copy_orders_copy_the_slots_of_every_layer_of_the_group(dtype):
    main = {0: _kv(0, dtype, 1), 1: _kv(1, dtype, 2)}
    draft = {0: _kv(0, dtype, 3)}
    tensors = CacheTensors(pools=[], caches=main, draft_caches=draft)
    before = {
        (name, i): (c.key.clone(), c.value.clone())
        for name, caches in (("main", main), ("draft", draft))
        for i, c in caches.items()
    }
    assert run_copies(tensors, [CopyOrder(0, 2, 5, 3)]) == 3
    for (name, i), (key, value) in before.items():
        cache = (main if name == "main" else draft)[i]
        expect_key, expect_value = key.clone(), value.clone()
        if cache.group == group_key(0):
            expect_key[5, :3] = key[2, :3]
            expect_value[5, :3] = value[2, :3]
        # compare bytes: fp8 has no equality kernel everywhere, and bits are the point
        assert torch.equal(cache.key.view(torch.uint8), expect_key.view(torch.uint8))
        assert torch.equal(cache.value.view(torch.uint8), expect_value.view(torch.uint8))
    assert not torch.equal(main[0].key[5, :3].float(), before[("main", 0)][0][5, :3].float())


def test_copy_order_for_a_group_without_layers_is_a_typed_error():
    tensors = CacheTensors(pools=[], caches={0: _kv(0, torch.float32, 1)})
    with pytest.raises(EngineError, match="group 7"):
        run_copies(tensors, [CopyOrder(7, 1, 2, 1)])
    with pytest.raises(EngineError, match="5 slots"):
        run_copies(tensors, [CopyOrder(0, 1, 2, 5)])

"""Batched kernels against their per-request oracles on random varlen batches.

Every batch mixes fresh prefills, continued prefill chunks, decode rows and verify rows
(1 + drafts); unused blocks and slots hold NaN, so a read of the null block, of a
padding cell's page or of a fresh request's old slot shows up as NaN in the outputs.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.models.gated_deltanet import GatedDeltaNet  # noqa: E402
from hybridkv.engine.models.gdn_projection import GDNShape  # noqa: E402
from hybridkv.engine.models.mamba1 import Mamba1  # noqa: E402
from hybridkv.engine.models.mamba2 import Mamba2, Mamba2Shape  # noqa: E402
from hybridkv.engine.models.short_conv import ShortConv  # noqa: E402
from hybridkv.engine.ops import delta_rule  # noqa: E402
from hybridkv.engine.ops.attention import paged_attention  # noqa: E402
from hybridkv.engine.ops.attention_reference import paged_attention_reference  # noqa: E402
from hybridkv.engine.ops.context import BlockTable, KVCache, StateCache, StateSlots, make_batch  # noqa: E402
from hybridkv.engine.ops.state_ops import gated_delta_rule_capture  # noqa: E402

NULL = 0


def random_rows(rng: random.Random, num_reqs: int) -> list[tuple[int, int]]:
    """(num_computed, num_new) per request: decode, verify, continued and fresh prefill."""
    rows = []
    for _ in range(num_reqs):
        kind = rng.choice(["decode", "verify", "chunk", "fresh"])
        computed = 0 if kind == "fresh" else rng.randrange(1, 40)
        new = {"decode": 1, "verify": rng.randrange(2, 6)}.get(kind, rng.randrange(1, 30))
        rows.append((computed, new))
    return rows


def attention_case(seed: int, window: int | None, block_size: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = random_rows(rng, rng.randrange(1, 7))
    heads, kv_heads, dim = 4, 2, 8
    max_blocks = max(-(-(c + n) // block_size) for c, n in rows)
    num_blocks = 1 + len(rows) * max_blocks
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    table = torch.tensor(ids).view(len(rows), max_blocks)
    key = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    value = torch.full_like(key, float("nan"))
    for r, (computed, _) in enumerate(rows):
        first = 0 if window is None else max(0, computed - window + 1)
        for p in range(first, computed):  # cached keys the step may read
            blk, off = int(table[r, p // block_size]), p % block_size
            key[blk, off] = torch.randn(kv_heads, dim, generator=gen)
            value[blk, off] = torch.randn(kv_heads, dim, generator=gen)
        if window is not None:  # blocks wholly before the window are released
            table[r, : first // block_size] = NULL
    chunks = [([1] * n, c) for c, n in rows]
    batch = make_batch(chunks, {"g": BlockTable(table, block_size)})
    total = sum(n for _, n in rows)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    return batch, KVCache(key, value, "g"), q, k, v, gen


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("window", "softcap", "sinks"), [(None, None, False), (7, None, False), (5, 3.0, True)]
)
def test_batched_attention_matches_reference(seed, window, softcap, sinks):
    block_size = [1, 4, 16][seed % 3]
    batch, cache, q, k, v, gen = attention_case(seed, window, block_size)
    sink = torch.randn(q.shape[1], generator=gen) if sinks else None
    ref_cache = KVCache(cache.key.clone(), cache.value.clone(), "g")
    kwargs = {"scale": 0.3, "sliding_window": window, "softcap": softcap, "sinks": sink}
    got = paged_attention(q, k, v, cache, batch, **kwargs)
    want = paged_attention_reference(q, k, v, ref_cache, batch, **kwargs)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.key, ref_cache.key, equal_nan=True)
    torch.testing.assert_close(cache.value, ref_cache.value, equal_nan=True)


def gdn_layer(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
    """A tiny Gated DeltaNet layer (conv dim 48), weights drawn in float32, then cast."""
    shape = GDNShape(
        hidden_size=16, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=4, conv_kernel=4
    )
    w_qkv = (torch.randn(shape.conv_dim, 16, generator=gen) * 0.3).to(dtype)
    w_z = (torch.randn(shape.value_dim, 16, generator=gen) * 0.3).to(dtype)
    w_b = (torch.randn(shape.num_v_heads, 16, generator=gen) * 0.3).to(dtype)
    w_a = (torch.randn(shape.num_v_heads, 16, generator=gen) * 0.3).to(dtype)

    def project(x):
        return x @ w_qkv.T, x @ w_z.T, x @ w_b.T, x @ w_a.T

    return GatedDeltaNet(
        shape=shape,
        project=project,
        conv_weight=(torch.randn(shape.conv_dim, 4, generator=gen) * 0.5).to(dtype),
        dt_bias=torch.randn(4, generator=gen).to(dtype),
        A_log=(torch.randn(4, generator=gen) * 0.3).to(dtype),
        norm_weight=torch.randn(4, generator=gen).to(dtype),
        out_proj=(torch.randn(16, shape.value_dim, generator=gen) * 0.3).to(dtype),
        eps=1e-6,
    )


def check_state_layer(layer, seed: int, hidden: int, conv_shape, ssm_shape) -> None:
    """Outputs and every slot (read, written at checkpoints, spec points, untouched) of
    ``layer.forward(batched=True)`` agree with the per-request loop."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    rows = random_rows(rng, rng.randrange(1, 7))
    num_slots = 1 + 4 * len(rows)
    slots = list(range(1, num_slots))
    rng.shuffle(slots)
    conv = torch.full((num_slots, *conv_shape), float("nan"))
    ssm = torch.full((num_slots, *ssm_shape), float("nan"))
    reads, writes = [], []
    for computed, new in rows:
        mine = [slots.pop() for _ in range(4)]
        read = mine[0] if computed else None
        if read is not None:
            conv[read] = torch.randn(conv.shape[1:], generator=gen)
            ssm[read] = torch.randn(ssm.shape[1:], generator=gen) * 0.3
        drafts = rng.randrange(0, min(new, 3))
        points = [(new - drafts, rng.choice([mine[0] if read else mine[1], mine[1]]))]
        points += [(new - drafts + i + 1, mine[2 + i]) for i in range(min(drafts, 2))]
        if rng.random() < 0.5:
            points.append((rng.randrange(0, new + 1), mine[3]))
        reads.append(read)
        writes.append(points)
    batch = make_batch(
        [([1] * n, c) for c, n in rows],
        state_slots={"s": StateSlots.from_points(reads, writes)},
    )
    x = torch.randn(sum(n for _, n in rows), hidden, generator=gen)
    ref = StateCache(conv.clone(), ssm.clone(), "s")
    got_cache = StateCache(conv, ssm, "s")
    got = layer.forward(x, batch, got_cache, batched=True)
    want = layer.forward(x, batch, ref, batched=False)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_cache.conv, ref.conv, equal_nan=True)
    torch.testing.assert_close(got_cache.ssm, ref.ssm, equal_nan=True, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(16))
def test_batched_gated_deltanet_matches_reference(seed):
    layer = gdn_layer(torch.Generator().manual_seed(seed))
    check_state_layer(layer, seed, 16, (layer.shape.conv_dim, 3 + 2), (4, 4, 8))


def rand(gen: torch.Generator, *shape: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


@pytest.mark.parametrize("seed", range(12))
def test_batched_mamba2_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = Mamba2Shape(
        hidden_size=16,
        num_heads=4,
        head_dim=4,
        state_size=6,
        n_groups=2,
        conv_kernel=4,
        use_conv_bias=True,
        use_bias=False,
    )
    layer = Mamba2(
        shape=shape,
        in_proj=rand(gen, shape.inner + shape.conv_dim + shape.num_heads, 16),
        in_bias=None,
        conv_weight=rand(gen, shape.conv_dim, 4, scale=0.5),
        conv_bias=rand(gen, shape.conv_dim),
        dt_bias=rand(gen, 4),
        A_log=rand(gen, 4),
        D=rand(gen, 4, scale=1.0),
        norm_weight=rand(gen, shape.inner, scale=1.0),
        out_proj=rand(gen, 16, shape.inner),
        out_bias=None,
        eps=1e-6,
        dt_min=0.0,
        ssm_dtype=None,
    )
    check_state_layer(layer, seed, 16, (shape.conv_dim, 3), (4, 4, 6))


@pytest.mark.parametrize("seed", range(12))
def test_batched_mamba1_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    inner, n, rank = 12, 5, 3
    layer = Mamba1(
        hidden_size=16,
        inner=inner,
        state_size=n,
        dt_rank=rank,
        conv_kernel=4,
        in_proj=rand(gen, 2 * inner, 16),
        in_bias=None,
        conv_weight=rand(gen, inner, 4, scale=0.5),
        conv_bias=rand(gen, inner),
        x_proj=rand(gen, rank + 2 * n, inner),
        dt_proj=rand(gen, inner, rank),
        dt_bias=rand(gen, inner),
        A_log=rand(gen, inner, n),
        D=rand(gen, inner, scale=1.0),
        dt_norm=rand(gen, rank, scale=1.0),
        b_norm=rand(gen, n, scale=1.0),
        c_norm=rand(gen, n, scale=1.0),
        out_proj=rand(gen, 16, inner),
        out_bias=None,
        eps=1e-6,
    )
    check_state_layer(layer, seed, 16, (inner, 3 + 1), (inner, n))


@pytest.mark.parametrize("seed", range(12))
def test_batched_short_conv_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    layer = ShortConv(
        hidden_size=16,
        kernel=3,
        in_proj=rand(gen, 48, 16),
        in_bias=rand(gen, 48),
        conv_weight=rand(gen, 16, 3, scale=0.5),
        conv_bias=None,
        out_proj=rand(gen, 16, 16),
        out_bias=None,
    )
    check_state_layer(layer, seed, 16, (16, 2 + 2), (0,))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chunk_tokens", [1, 3, 16])
def test_chunked_delta_rule_matches_recurrence(seed, chunk_tokens):
    """Padded rows of different lengths, states captured inside and at the ends of chunks."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [rng.randrange(1, 20) for _ in range(rng.randrange(1, 4))]
    width, heads, dk, dv = max(lengths), 3, 8, 4

    def grid(*shape):
        x = torch.randn(len(lengths), width, *shape, generator=gen)
        for r, n in enumerate(lengths):
            x[r, n:] = 0
        return x

    q, k, v = grid(heads, dk), grid(heads, dk), grid(heads, dv)
    g = -grid(heads).abs()
    beta = torch.sigmoid(grid(heads))
    for r, n in enumerate(lengths):
        beta[r, n:] = 0
    state = torch.randn(len(lengths), heads, dk, dv, generator=gen)
    rows = [r for r, n in enumerate(lengths) for _ in range(2)]
    ks = [kk for n in lengths for kk in (n, rng.randrange(0, n + 1))]
    pq, pk, pv, pg, pb = delta_rule.prepare(q, k, v, g, beta)
    out, captured = delta_rule.delta_rule_chunked(
        pq, pk, pv, pg, pb, state, torch.tensor(rows), ks, chunk_tokens
    )
    for r, n in enumerate(lengths):
        want, states = gated_delta_rule_capture(
            q[r, :n], k[r, :n], v[r, :n], g[r, :n], beta[r, :n], state[r], set(ks)
        )
        torch.testing.assert_close(out[r, :n], want, rtol=1e-4, atol=1e-5)
        for p, (row, kk) in enumerate(zip(rows, ks, strict=True)):
            if row == r:
                torch.testing.assert_close(captured[p], states[kk], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length", [5, 64, 100])
def test_chunked_capture_of_each_row_end_is_bit_identical_to_indexed(monkeypatch, length):
    """A point at every row's end skips the row indexing (`_each_row_once`); same bits."""
    gen = torch.Generator().manual_seed(length)
    rows_n, heads, dk, dv = 4, 2, 8, 8
    q, k = (torch.randn(rows_n, length, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows_n, length, heads, dv, generator=gen)
    g = -torch.rand(rows_n, length, heads, generator=gen)
    beta = torch.rand(rows_n, length, heads, generator=gen)
    stored = torch.randn(rows_n, heads, dv, dk, generator=gen)
    args = (*delta_rule.prepare(q, k, v, g, beta), stored.transpose(-1, -2))
    rows, ks = torch.arange(rows_n), [length] * rows_n
    fast = delta_rule.delta_rule_chunked(*args, rows, ks)
    assert delta_rule._each_row_once(rows, rows_n)
    monkeypatch.setattr(delta_rule, "_each_row_once", lambda prow, num_rows: False)
    indexed = delta_rule.delta_rule_chunked(*args, rows, ks)
    assert torch.equal(fast[0], indexed[0]) and torch.equal(fast[1], indexed[1])

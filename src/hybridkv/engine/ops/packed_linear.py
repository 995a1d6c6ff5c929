"""``F.linear`` with weights pre-packed for oneDNN when the model runs bf16 on a CPU.

A bf16 ``F.linear`` on a CPU goes to oneDNN, which reorders the weight into its blocked
layout on every call; at decode sizes (1-32 rows) that reorder costs as much as the
product itself. Packing each weight once (``mkldnn._reorder_linear_weight``) and calling
``mkldnn._linear_pointwise`` runs the same oneDNN kernel on the same blocked weight:
measured here bit-identical to ``F.linear`` for 1 to 300 rows (tests/engine/
test_packed_linear.py checks it), and 1.3-2.8x faster per product for 1-32 rows (one
thread, ``[1536, 512]`` and ``[4096, 512]`` weights). float32 is never packed: it runs
MKL's sgemm, whose sums the exactness tests hold against transformers.

A weight is packed the second time the same tensor object is seen (a tensor made afresh
per call, e.g. a slice taken inside a forward, is never packed, so never paid for); the
packed copy hangs on the tensor as an attribute and lives as long as it does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACKED = "_hybridkv_packed"
_SEEN = "_hybridkv_seen"


def _supported() -> bool:
    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):  # a torch build without oneDNN ops
        return False


ENABLED = _supported()


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        ENABLED
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() == 2
        and weight.dim() == 2
        and weight.is_contiguous()
        and not weight.requires_grad
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; bf16 on a CPU through a packed weight (module doc)."""
    packed = getattr(weight, _PACKED, None)
    if packed is not None and bias is None and x.dtype == torch.bfloat16 and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if packed is not None or bias is not None or not _packable(x, weight):
        return F.linear(x, weight, bias)
    if not getattr(weight, _SEEN, False):
        setattr(weight, _SEEN, True)
        return F.linear(x, weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[0])
    setattr(weight, _PACKED, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


__all__ = ["ENABLED", "linear"]

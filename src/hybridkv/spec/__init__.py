"""Layer specs, model specs and dtypes."""

from hybridkv.spec.dtypes import DType, parse_dtype
from hybridkv.spec.layers import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    KINDS,
    MLA,
    SLIDING_ATTENTION,
    STATE,
    AttentionSpec,
    ChunkedLocalSpec,
    GatedDeltaNetSpec,
    KDASpec,
    LayerSpec,
    LightningSpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    ShortConvSpec,
    SlidingWindowSpec,
    StateSpec,
)
from hybridkv.spec.model import ModelSpec

__all__ = [
    "CHUNKED_ATTENTION",
    "FULL_ATTENTION",
    "KINDS",
    "MLA",
    "SLIDING_ATTENTION",
    "STATE",
    "AttentionSpec",
    "ChunkedLocalSpec",
    "DType",
    "GatedDeltaNetSpec",
    "KDASpec",
    "LayerSpec",
    "LightningSpec",
    "MLASpec",
    "Mamba1Spec",
    "Mamba2Spec",
    "ModelSpec",
    "ShortConvSpec",
    "SlidingWindowSpec",
    "StateSpec",
    "parse_dtype",
]

"""Cache dtypes and their sizes. KV, conv and ssm dtypes are chosen independently."""

from __future__ import annotations

from enum import Enum

from hybridkv.errors import SpecError


class DType(str, Enum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def num_bytes(self) -> int:
        return _NUM_BYTES[self]

    def __str__(self) -> str:
        return self.value


_NUM_BYTES = {
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
}

# Spellings seen in HF configs and in vLLM flags, mapped to ours.
_ALIASES = {
    "bf16": DType.BFLOAT16,
    "bfloat16": DType.BFLOAT16,
    "fp16": DType.FLOAT16,
    "half": DType.FLOAT16,
    "float16": DType.FLOAT16,
    "fp32": DType.FLOAT32,
    "float": DType.FLOAT32,
    "float32": DType.FLOAT32,
    "fp8": DType.FP8_E4M3,
    "fp8_e4m3": DType.FP8_E4M3,
    "fp8_e4m3fn": DType.FP8_E4M3,
    "float8_e4m3fn": DType.FP8_E4M3,
    "fp8_e5m2": DType.FP8_E5M2,
    "float8_e5m2": DType.FP8_E5M2,
}


def parse_dtype(value: str | DType, *, what: str = "dtype") -> DType:
    """Parse a dtype name (ours, HF's or vLLM's spelling); raise `SpecError` otherwise."""
    if isinstance(value, DType):
        return value
    key = str(value).strip().lower().removeprefix("torch.")
    if key in _ALIASES:
        return _ALIASES[key]
    raise SpecError(f"unknown {what} {value!r}; use one of {', '.join(d.value for d in DType)}")

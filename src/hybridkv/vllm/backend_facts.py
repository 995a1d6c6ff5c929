"""Small readers of vLLM objects shared by the block-size hook and the 0.33 builder.

`hybridkv.vllm.hooks` (the block-size hook, every supported version) and
`hybridkv.vllm.builder` (vLLM 0.33's grouping) both name dtypes and ask an attention
backend for its kernel block unit; both import these from here, so neither imports
the other's internals. vLLM is imported inside the functions only.
"""

from __future__ import annotations

from typing import Any

from hybridkv.errors import HybridKVError


def dtype_name(dtype: Any) -> str:
    """torch dtype or vLLM's dtype string -> hybridkv's dtype name."""
    text = str(dtype).removeprefix("torch.")
    return {"fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(
        text, text
    )


def backend_align_tokens(backend_cls: Any) -> int:
    """The attention kernel's block unit; padded pages rule out kernel-block splitting,
    so only backends that take any multiple of a unit qualify."""
    from vllm.v1.attention.backend import MultipleOf

    sizes = backend_cls.get_supported_kernel_block_sizes()
    units = [s.base for s in sizes if isinstance(s, MultipleOf)]
    if not units:
        raise HybridKVError(
            f"attention backend {backend_cls.__name__} takes only fixed kernel block sizes "
            f"{sizes}; hybridkv plans need a block unit"
        )
    return min(units)

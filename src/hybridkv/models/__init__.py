"""Model adapters: a Hugging Face ``config.json`` or a built-in preset -> `ModelSpec`."""

from hybridkv.models.registry import (
    PresetInfo,
    decoder_layer_indices,
    from_hf_config,
    list_presets,
    load_model_spec,
    supported_model_types,
)

__all__ = [
    "PresetInfo",
    "decoder_layer_indices",
    "from_hf_config",
    "list_presets",
    "load_model_spec",
    "supported_model_types",
]

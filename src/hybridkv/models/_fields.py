"""Reading fields of a Hugging Face ``config.json`` dict, with errors that name the field.

Policy, the same for every family:

* a field absent from the dict takes the default of that family's ``transformers`` config
  class (each adapter module lists those defaults next to its adapters, copied from
  ``transformers/models/<family>/configuration_*.py``), exactly as ``from_pretrained``
  would fill it in;
* the layer count, the attention head count and the hidden size have no default here:
  every real checkpoint states them, so a config without them is truncated and we raise
  `ConfigError` rather than size a cache for the class's example model;
* a present field of the wrong type or value raises `ConfigError` naming the field.

Layer types are normalised to transformers' current names (``full_attention``,
``sliding_attention``, ``linear_attention``, ``conv``, ``mlp``, ``moe``, ``hybrid``);
legacy names (``attention``, ``mamba``) are mapped as ``transformers`` maps them
(``configuration_utils._LEGACY_LAYER_TYPE_REMAP``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.errors import ConfigError, SpecError
from hybridkv.spec.dtypes import DType, parse_dtype
from hybridkv.spec.layers import LayerSpec

_MISSING = object()

LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}

# Keys that name the ssm (recurrent state) dtype in released configs: Qwen3.5 checkpoints
# carry ``mamba_ssm_dtype``; NemotronHConfig has ``mamba_ssm_cache_dtype``.
SSM_DTYPE_KEYS = ("mamba_ssm_dtype", "mamba_ssm_cache_dtype")
# Keys that count MTP (multi-token prediction) layers, in order of preference.
MTP_KEYS = ("mtp_num_hidden_layers", "mtp_num_layers", "num_nextn_predict_layers", "num_mtp_layers")

# Limits on config numbers, checked as the fields are read. The largest released models
# have under 200 decoder layers; an absurd count (2^31 layers) would otherwise build
# billions of layer specs before anything could fail. No size or count in a real config
# comes near 2^32.
MAX_LAYERS = 1024
LAYER_COUNT_KEYS = frozenset({"num_hidden_layers", *MTP_KEYS})
MAX_FIELD_VALUE = 1 << 32

IndexedLayers = list[tuple[int, LayerSpec]]
"""(decoder-layer index, spec) pairs in model order; see `registry.decoder_layer_indices`."""


def _short(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a corrupt field cannot flood a log."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ConfigReader:
    """Typed access to one config dict; ``defaults`` are the family's transformers defaults."""

    config: Mapping[str, Any]
    model_type: str
    defaults: Mapping[str, Any] = field(default_factory=dict)

    # -- raw access
    def has(self, key: str) -> bool:
        """True when the dict states ``key`` with a non-null value."""
        return self.config.get(key) is not None

    def raw(self, key: str) -> Any:
        value = self.config.get(key, _MISSING)
        if value is _MISSING:
            value = self.defaults.get(key, _MISSING)
        if value is _MISSING:
            raise self.error(key, "is missing")
        return value

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"config field {key!r} {problem} (model_type {self.model_type!r})")

    # -- typed access
    def get_int(self, key: str, *, minimum: int = 1) -> int:
        value = self.raw(key)
        if value is None:
            raise self.error(key, f"is null; it must be an integer >= {minimum}")
        return self._positive(key, value, minimum)

    def get_optional_int(self, key: str) -> int | None:
        """The value, or None when absent (with no default) or null."""
        value = self.config.get(key, self.defaults.get(key))
        return None if value is None else self._positive(key, value)

    def get_first_int(self, keys: Sequence[str]) -> int:
        """The first of ``keys`` the dict states; else the first one with a default."""
        for key in keys:
            if self.has(key):
                return self.get_int(key)
        for key in keys:
            if self.defaults.get(key) is not None:
                return self.get_int(key)
        raise self.error(" / ".join(keys), "is missing")

    def get_str(self, key: str) -> str | None:
        value = self.config.get(key, self.defaults.get(key))
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_short(value)}")
        return value

    def get_list(self, key: str) -> list[Any] | None:
        value = self.config.get(key, self.defaults.get(key))
        if value is not None and not isinstance(value, list | tuple):
            raise self.error(key, f"must be a list, got {type(value).__name__}")
        return None if value is None else list(value)

    def _positive(self, key: str, value: Any, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(key, f"must be {what}, got {_short(value)}")
        return self._bounded(key, value)

    def _bounded(self, key: str, value: int) -> int:
        limit = MAX_LAYERS if key in LAYER_COUNT_KEYS else MAX_FIELD_VALUE
        if value > limit:
            what = "layers" if key in LAYER_COUNT_KEYS else "for any config field"
            raise self.error(
                key,
                f"is {_short(value)}, above hybridkv's limit of {limit} {what}; is the "
                "config corrupt?",
            )
        return value

    # -- model-wide values
    @property
    def dtype(self) -> DType:
        """The model dtype: ``dtype`` (transformers 5) or ``torch_dtype``; bfloat16 if unset."""
        for key in ("dtype", "torch_dtype"):
            if self.has(key):
                return self._dtype(key)
        return DType.BFLOAT16

    @property
    def ssm_dtype(self) -> DType:
        """The recurrent-state dtype the config asks for, else the model dtype."""
        for key in SSM_DTYPE_KEYS:
            if self.config.get(key, self.defaults.get(key)) is not None:
                return self._dtype(key)
        return self.dtype

    def _dtype(self, key: str) -> DType:
        value = self.raw(key)
        try:
            return parse_dtype(str(value), what=key)
        except SpecError as err:
            raise self.error(key, f"is not a dtype we know: {err}") from err

    @property
    def num_mtp_layers(self) -> int:
        for key in MTP_KEYS:
            value = self.config.get(key, self.defaults.get(key))
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise self.error(key, f"must be a non-negative integer, got {_short(value)}")
                return self._bounded(key, value)
        return 0

    @property
    def max_position_embeddings(self) -> int | None:
        for key in ("max_position_embeddings", "model_max_length"):
            if self.has(key):
                return self.get_int(key)
        return self.get_optional_int("max_position_embeddings")

    # -- layer patterns
    def layer_types(
        self, keys: Sequence[str], num_layers: int, allowed: Sequence[str]
    ) -> list[str] | None:
        """The per-layer type list under the first of ``keys`` present, validated; else None."""
        for key in keys:
            value = self.get_list(key) if key in self.config else None
            if value is None:
                continue
            types = [LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in value]
            bad = sorted({repr(t) for t in types if t not in allowed})
            if bad:
                raise self.error(
                    key,
                    f"has unknown layer types {', '.join(bad)}; "
                    f"this family allows {', '.join(allowed)}",
                )
            if len(types) != num_layers:
                raise self.error(
                    key, f"lists {len(types)} layers but num_hidden_layers is {num_layers}"
                )
            return types
        return None


def build_layers(
    types: Sequence[str], makers: Mapping[str, Callable[[int], Sequence[LayerSpec]]]
) -> IndexedLayers:
    """Turn per-layer type names into (index, spec) pairs; a type may map to 0, 1 or 2 specs."""
    out: IndexedLayers = []
    for index, layer_type in enumerate(types):
        out.extend((index, spec) for spec in makers[layer_type](index))
    return out


def head_dim_or_ratio(r: ConfigReader) -> int:
    """``head_dim`` when stated, else hidden_size // num_attention_heads (transformers' rule)."""
    head_dim = r.get_optional_int("head_dim")
    if head_dim is not None:
        return head_dim
    return r.get_int("hidden_size") // r.get_int("num_attention_heads")


def num_kv_heads(r: ConfigReader) -> int:
    """``num_key_value_heads``; a null or absent one (with no class default) means MHA."""
    value = r.get_optional_int("num_key_value_heads")
    return r.get_int("num_attention_heads") if value is None else value


@dataclass(frozen=True)
class Adapter:
    """One row of the dispatch table: how to read one ``model_type``.

    ``family`` names the architecture family (shown by ``hybridkv models``); ``defaults``
    are the transformers config-class defaults the adapter may fall back on.
    """

    family: str
    build: Callable[[ConfigReader], IndexedLayers]
    defaults: Mapping[str, Any] = field(default_factory=dict)

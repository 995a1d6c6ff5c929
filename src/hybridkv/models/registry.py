"""From a Hugging Face ``config.json`` (dict, file, folder) or a preset name to a `ModelSpec`.

``TABLE`` maps each ``model_type`` to its adapter (one row per type; the adapters live in
one module per family). Multimodal wrappers (``gemma3``, ``qwen3_5``, ``qwen3_5_moe``)
are read through their ``text_config``.

Layer order and indices: ``ModelSpec.layers`` lists the cache-holding layers in model
order. Layers that hold no cache (Nemotron-H MLP ``-`` and MoE ``E`` layers) are skipped,
and a Falcon-H1 decoder layer gives two specs (attention, then Mamba2), so position ``k``
in ``layers`` is not always decoder layer ``k``; `decoder_layer_indices` gives, for each
position, the decoder-layer index it belongs to::

    Nemotron-H pattern "M-M*E":   layers = (mamba2, mamba2, attn)
                                  decoder_layer_indices = (0, 2, 3)
    Falcon-H1, 2 layers:          layers = (attn, mamba2, attn, mamba2)
                                  decoder_layer_indices = (0, 0, 1, 1)

Presets are HF-style config files in ``models/presets/<name>.json`` with an extra
``"_hybridkv"`` key (name, hf_id, family, source, notes); ``scripts/make_presets.py``
writes them from the shared model table.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.errors import ConfigError, SpecError
from hybridkv.models import dense, mamba_hybrids, others, qwen_hybrid
from hybridkv.models._fields import Adapter, ConfigReader, IndexedLayers
from hybridkv.spec.model import ModelSpec

TABLE: dict[str, Adapter] = {
    **dense.ADAPTERS,
    **qwen_hybrid.ADAPTERS,
    **mamba_hybrids.ADAPTERS,
    **others.ADAPTERS,
}

# Wrapper model_type -> model_type of its text_config when that does not say.
WRAPPERS: dict[str, str] = {
    "gemma3": "gemma3_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
# Wrapper keys a text_config inherits when it does not state them itself.
_INHERITED = (
    "dtype",
    "torch_dtype",
    "mamba_ssm_dtype",
    "mamba_ssm_cache_dtype",
    "mtp_num_hidden_layers",
    "_name_or_path",
    "_hybridkv",
)

META_KEY = "_hybridkv"
PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class PresetInfo:
    """One built-in preset, as `hybridkv models` lists it."""

    name: str
    family: str
    model_type: str
    hf_id: str
    layer_mix: str
    source: tuple[str, ...]


def supported_model_types() -> list[str]:
    return sorted([*TABLE, *WRAPPERS])


def _unsupported(model_type: object) -> ConfigError:
    shown = repr(model_type) if len(repr(model_type)) <= 60 else repr(model_type)[:57] + "..."
    hint = ""
    if isinstance(model_type, str):
        close = difflib.get_close_matches(model_type, supported_model_types(), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return ConfigError(
        f"unsupported model_type {shown}{hint}; supported model types: "
        f"{', '.join(supported_model_types())}"
    )


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The dict the adapter reads: ``config`` itself, or a wrapper's ``text_config``."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str | None):  # e.g. a dict: unhashable, never a type
        raise ConfigError(
            f"config field 'model_type' must be a string, got {type(model_type).__name__}"
        )
    if model_type in TABLE:
        return config
    text = config.get("text_config")
    if text is None:
        if model_type in WRAPPERS:
            raise ConfigError(f"config field 'text_config' is missing (model_type {model_type!r})")
        raise _unsupported(model_type)
    if not isinstance(text, Mapping):
        raise ConfigError(f"config field 'text_config' must be an object, got {text!r}")
    merged = dict(text)
    for key in _INHERITED:
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    if merged.get("model_type") is None and model_type in WRAPPERS:
        merged["model_type"] = WRAPPERS[str(model_type)]
    return merged


def _adapt(
    config: Mapping[str, Any], name: str | None, source: str
) -> tuple[ModelSpec, IndexedLayers]:
    if not isinstance(config, Mapping):
        raise ConfigError(f"a model config must be a JSON object, got {type(config).__name__}")
    cfg = text_config(config)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in TABLE:
        raise _unsupported(model_type)
    adapter = TABLE[model_type]
    reader = ConfigReader(cfg, model_type, adapter.defaults)
    raw_meta = cfg.get(META_KEY)
    meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, Mapping) else {}
    try:
        indexed = adapter.build(reader)
        spec = ModelSpec(
            name=str(name or meta.get("name") or cfg.get("_name_or_path") or model_type),
            model_type=model_type,
            layers=tuple(layer for _, layer in indexed),
            dtype=reader.dtype,
            max_position_embeddings=reader.max_position_embeddings,
            num_mtp_layers=reader.num_mtp_layers,
            source=source,
        )
    except SpecError as err:
        raise ConfigError(f"model_type {model_type!r}: {err}") from err
    return spec, indexed


def from_hf_config(
    config: Mapping[str, Any], *, name: str | None = None, source: str = ""
) -> ModelSpec:
    """The `ModelSpec` of a HF ``config.json`` dict (unsharded; the planner applies TP).

    Raises `ConfigError` for an unknown ``model_type`` (listing the supported ones) or a
    missing / malformed field (naming it).
    """
    return _adapt(config, name, source)[0]


def decoder_layer_indices(config: Mapping[str, Any]) -> tuple[int, ...]:
    """For each entry of ``from_hf_config(config).layers``, its decoder-layer index."""
    return tuple(index for index, _ in _adapt(config, None, "")[1])


# --------------------------------------------------------------------------- loading


def _presets_dir() -> Any:
    return resources.files("hybridkv.models").joinpath("presets")


def preset_names() -> list[str]:
    return sorted(
        p.name[: -len(".json")] for p in _presets_dir().iterdir() if p.name.endswith(".json")
    )


def _read_json(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not valid JSON: {err}") from err
    except (ValueError, RecursionError) as err:  # an int of > 4300 digits, deep nesting
        raise ConfigError(f"{where} is not a JSON config we can read: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(data).__name__}")
    return data


def load_config(path_or_preset: PathLike) -> tuple[dict[str, Any], str]:
    """(config dict, source) for a ``config.json`` path, a folder holding one, or a preset."""
    path = Path(path_or_preset)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"folder {path.parent} holds no config.json")
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path} is not UTF-8 text (byte {err.start})") from None
        return _read_json(text, str(path)), str(path)
    name = resolve_preset_name(str(path_or_preset))
    config = _read_json(_presets_dir().joinpath(f"{name}.json").read_text(encoding="utf-8"), name)
    return config, f"preset {name}"


def _hf_ids() -> dict[str, str]:
    """Lowercase Hugging Face id -> preset name, from each preset's ``_hybridkv.hf_id``."""
    ids: dict[str, str] = {}
    for name in preset_names():
        text = _presets_dir().joinpath(f"{name}.json").read_text(encoding="utf-8")
        meta = json.loads(text).get(META_KEY, {})
        hf_id = meta.get("hf_id") if isinstance(meta, dict) else None
        if isinstance(hf_id, str) and hf_id:
            ids[hf_id.lower()] = name
    return ids


def resolve_preset_name(text: str) -> str:
    """The preset ``text`` names: a preset name (any case), or a Hugging Face id such as
    ``Qwen/Qwen3.5-9B`` whose repository name (any case) is a preset. Raises `ConfigError`
    with the closest preset names otherwise."""
    key = text.strip().lower()
    names = preset_names()
    if key in names:
        return key
    if "/" in key:
        hf_ids = _hf_ids()
        if key in hf_ids:
            return hf_ids[key]
        repo = key.rsplit("/", 1)[1]
        if repo in names:
            return repo
    guess = key.rsplit("/", 1)[-1]
    close = difflib.get_close_matches(guess, names, n=3, cutoff=0.6)
    where = "neither a config.json, a folder holding one, nor a preset"
    if "/" in key:
        where = "not a file or folder, and no preset matches that Hugging Face id"
    if close:
        raise ConfigError(
            f"{text!r} is {where}; did you mean {' or '.join(close)}? "
            "(hybridkv models lists every preset)"
        )
    raise ConfigError(f"{text!r} is {where}; presets: {', '.join(names)}")


def load_model_spec(path_or_preset: PathLike | Mapping[str, Any]) -> ModelSpec:
    """A `ModelSpec` from a preset name (any case), a ``config.json``, a folder, or a dict."""
    if isinstance(path_or_preset, Mapping):
        return from_hf_config(path_or_preset)
    config, source = load_config(path_or_preset)
    return from_hf_config(config, source=source)


def list_presets() -> list[PresetInfo]:
    """Every built-in preset with its family, layer mix and sources, sorted by name."""
    infos = []
    for name in preset_names():
        config, source = load_config(name)
        meta = config.get(META_KEY, {})
        spec = from_hf_config(config, source=source)
        infos.append(
            PresetInfo(
                name=name,
                family=str(meta.get("family", TABLE[spec.model_type].family)),
                model_type=str(config.get("model_type")),
                hf_id=str(meta.get("hf_id", "")),
                layer_mix=spec.layer_mix(),
                source=tuple(meta.get("source", ())),
            )
        )
    return infos

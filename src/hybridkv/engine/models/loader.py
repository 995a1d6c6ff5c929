"""Read a transformers checkpoint folder: ``config.json`` plus ``*.safetensors``.

Weights are addressed by transformers' parameter names. Sharded checkpoints are read
through ``model.safetensors.index.json``. Every tensor a model takes is checked against
the shape its config implies, so a checkpoint that does not match its config fails at
load time with the tensor's name and both shapes, not later with a matmul error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hybridkv.errors import EngineError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder (or the file itself) as a dict."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise EngineError(f"no config.json at {config_file}") from None
    except json.JSONDecodeError as err:
        raise EngineError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise EngineError(f"{config_file} must hold a JSON object")
    return config


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint: the index's shards, or the single file."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            names = sorted({str(name) for name in weight_map.values()})
        except (ValueError, AttributeError, TypeError) as err:
            raise EngineError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map' "
                f"of tensor -> file): {err}"
            ) from None
        return [folder / name for name in names]
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors weights in {folder}")
    return files


class Checkpoint:
    """The tensors of one checkpoint, handed out once each by name with a shape check."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"):
        from safetensors import safe_open

        self.folder = Path(folder)
        self.dtype = dtype
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        for file in safetensors_files(self.folder):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                        self._tensors[name] = handle.get_tensor(name)
            except FileNotFoundError:
                raise EngineError(f"weights file {file} is missing (listed by the index)") from None
            except Exception as err:  # SafetensorError, or a torch error on a bad header
                raise EngineError(
                    f"cannot read weights file {file}: {type(err).__name__}: {err}; the file "
                    "is truncated or not safetensors (download it again)"
                ) from None
        self._taken: set[str] = set()
        self._ignored: dict[str, str] = {}  # name prefix -> why the model does not take it

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name`` (`EngineError` if it is missing)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise EngineError(f"checkpoint {self.folder} has no tensor {name!r}")
        return tuple(tensor.shape)

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The tensor ``name`` converted to the model dtype, or `EngineError` if it is
        missing or its shape is not ``shape``."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise EngineError(f"checkpoint {self.folder} has no tensor {name!r}")
        if tuple(tensor.shape) != tuple(shape):
            raise EngineError(
                f"tensor {name!r} in {self.folder} has shape {tuple(tensor.shape)} but the "
                f"config implies {tuple(shape)}; the checkpoint does not match its config.json"
            )
        target = dtype or self.dtype
        if target.is_floating_point and not tensor.is_floating_point():
            raise EngineError(
                f"tensor {name!r} in {self.folder} is {tensor.dtype} but the model needs "
                f"floating-point weights ({target}); quantized or corrupt checkpoints are not "
                "supported by the reference engine"
            )
        self._taken.add(name)
        return tensor.to(device=self.device, dtype=target)

    def take_optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, shape) if self.has(name) else None

    def ignore(self, prefix: str, reason: str) -> None:
        """Tensors under ``prefix`` belong to a part loaded elsewhere (an MTP head: by
        `load_mtp` when speculative decoding asks for it); `unused` leaves them out and
        `ignored` says why."""
        self._ignored[prefix] = reason

    def ignored(self) -> dict[str, str]:
        """Untaken tensor names under an ignored prefix -> the reason."""
        return {
            name: reason
            for name in sorted(set(self._tensors) - self._taken)
            for prefix, reason in self._ignored.items()
            if name.startswith(prefix)
        }

    def unused(self) -> list[str]:
        """Tensors nobody took and nobody declared as loaded elsewhere."""
        ignored = self.ignored()
        return sorted(set(self._tensors) - self._taken - set(ignored))

    def check_all_used(self) -> None:
        """Refuse a checkpoint with tensors the config's layers did not take: a config of
        4 layers over 6-layer weights would otherwise run and emit wrong tokens. MTP heads
        (loaded apart, by `load_mtp`, when spec_method 'mtp' asks for them) and rotary
        caches are allowed to stay unused."""
        unused = [name for name in self.unused() if not _ignorable(name)]
        if unused:
            shown = ", ".join(unused[:8]) + (
                f", ... ({len(unused)} in all)" if len(unused) > 8 else ""
            )
            raise EngineError(
                f"checkpoint {self.folder} has {len(unused)} tensor(s) its config.json does not "
                f"use: {shown}; the config does not describe these weights (e.g. "
                "num_hidden_layers or layer_types is wrong)"
            )


# Checkpoint tensors that may stay unused: multi-token-prediction heads (Qwen3-Next /
# Qwen3.5 "mtp.*", DeepSeek-style "model.mtp.*") and the rotary inverse frequencies some
# exporters save as buffers.
_IGNORABLE_PREFIXES = ("mtp.", "model.mtp.")
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def _ignorable(name: str) -> bool:
    return name.startswith(_IGNORABLE_PREFIXES) or name.endswith(_IGNORABLE_SUFFIXES)


def cfg_get(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) in ``config``, else ``default``."""
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return default


def cfg_require(config: dict[str, Any], name: str) -> Any:
    value = config.get(name)
    if value is None:
        model_type = config.get("model_type", "?")
        raise EngineError(f"config.json (model_type {model_type}) has no {name!r}")
    return value


GENERATION_CONFIG = "generation_config.json"


def eos_token_ids(folder: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids `transformers` generate stops at for this checkpoint.

    As transformers loads them: ``generation_config.json`` when the folder has one (even
    when it has no ``eos_token_id``: then nothing stops generation), else ``config.json``
    (its ``text_config`` when the top level has none). An id or a list of ids; () for none.
    """
    folder = Path(folder)
    gen_file = folder / GENERATION_CONFIG
    if gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text())
        except json.JSONDecodeError as err:
            raise EngineError(f"{gen_file} is not valid JSON: {err}") from None
        value = gen.get("eos_token_id") if isinstance(gen, dict) else None
    else:
        config = read_config(folder)
        value = config.get("eos_token_id")
        text_config = config.get("text_config")
        if value is None and isinstance(text_config, dict):
            value = text_config.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EngineError(f"eos_token_id {value!r} of {folder} must be an id or a list of ids")
    return tuple(ids)

"""Reference model implementations, one module per architecture family.

`load_model(folder)` reads ``config.json``, picks the loader for its ``model_type`` from
`LOADERS` and returns a `CausalLM` whose `layers` describe the caches it expects.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridkv.engine.models.common import CausalLM, LayerDesc
from hybridkv.engine.models.loader import Checkpoint, read_config
from hybridkv.errors import EngineError

if TYPE_CHECKING:
    from hybridkv.engine.models.mtp import MTPHead

Loader = Callable[[dict[str, Any], Checkpoint], CausalLM]


def _loaders() -> dict[str, Loader]:
    from hybridkv.engine.models.falcon_h1 import load_falcon_h1
    from hybridkv.engine.models.gemma3 import load_gemma3
    from hybridkv.engine.models.gpt_oss import load_gpt_oss
    from hybridkv.engine.models.granite import load_granite
    from hybridkv.engine.models.jamba import load_jamba
    from hybridkv.engine.models.lfm2 import load_lfm2
    from hybridkv.engine.models.nemotron_h import load_nemotron_h
    from hybridkv.engine.models.qwen3 import load_qwen3
    from hybridkv.engine.models.qwen3_5 import load_qwen3_5

    return {
        "qwen3": load_qwen3,
        "qwen3_5_text": load_qwen3_5,
        "qwen3_next": load_qwen3_5,
        "gemma3_text": load_gemma3,
        "nemotron_h": load_nemotron_h,
        "granitemoehybrid": load_granite,
        "falcon_h1": load_falcon_h1,
        "gpt_oss": load_gpt_oss,
        "lfm2": load_lfm2,
        "jamba": load_jamba,
    }


def load_model(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Load a transformers checkpoint folder into the reference engine."""
    config = read_config(folder)
    model_type = config.get("model_type")
    loaders = _loaders()
    loader = loaders.get(str(model_type))
    if loader is None:
        raise EngineError(
            f"model_type {model_type!r} is not supported by the reference engine; "
            f"supported: {sorted(loaders)}"
        )
    checkpoint = Checkpoint(folder, dtype, device)
    model = loader(config, checkpoint)
    checkpoint.check_all_used()
    return model


def load_mtp(
    folder: str | Path, main: CausalLM, device: str | torch.device | None = None
) -> MTPHead:
    """The MTP head in ``folder`` (Qwen3.5 / Qwen3-Next), sharing ``main``'s embedding
    and LM head, in ``main``'s dtype on its device. ``folder`` is the main checkpoint
    itself, or a folder holding only the ``mtp.*`` tensors next to a ``config.json`` of
    the same architecture that states the MTP layer count (the demo's ``mtp/``)."""
    from hybridkv.engine.models.mtp import load_mtp_head

    ckpt = Checkpoint(folder, main.dtype, main.device if device is None else device)
    return load_mtp_head(read_config(folder), ckpt, main)


__all__ = ["CausalLM", "LayerDesc", "load_model", "load_mtp"]

"""The reference engine (torch). Its public names are imported lazily, so that importing
``hybridkv.engine`` for a submodule stays cheap::

    from hybridkv.engine import LLM, EngineConfig, SamplingParams

Subpackages, lowest first (each imports only from the ones before it; the modules
directly here, `llm`, `config`, `stepper`, `results`, build on all of them):

    sampling     sampling parameters, logits processing, token sampling, logprobs
    ops          the batch a step sees (`ops.context`) and the kernels that read it
    models       model code, checkpoint loading, tokenizers, the demo checkpoints
    forward      cache tensors as planned, device block tables, junction copies, the runner
    speculative  drafters and proposers, verification, token trees
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "hybridkv.engine.llm",
    "EngineConfig": "hybridkv.engine.config",
    "GenerationResult": "hybridkv.engine.results",
    "SamplingParams": "hybridkv.engine.sampling.sampler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridkv.engine' has no attribute {name!r}")

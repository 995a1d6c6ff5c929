"""`LLM`'s constructor and `generate` arguments, checked and resolved before anything
is loaded: the speculative method and K, ``max_model_len``, the device, the KV and ssm
dtypes, and per-prompt cache salts. Each raises `EngineError` naming the argument, the
value and what to pass instead."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from hybridkv.engine.models import LayerDesc
from hybridkv.engine.speculative.proposers import Proposer
from hybridkv.errors import EngineError, SpecError
from hybridkv.plan.planner import HEAD_METHODS
from hybridkv.plan.types import check_num_spec_tokens
from hybridkv.spec.dtypes import DType, parse_dtype

DEFAULT_MAX_MODEL_LEN = 4096


def resolve_max_model_len(requested: int | None, max_positions: int | None) -> int:
    """The checkpoint's positions when it states them, at most 4096 by default (the
    plan must hold one request of max_model_len tokens in ``memory_bytes``; pass more
    explicitly); a value past the checkpoint's positions is refused."""
    if requested is None:
        return min(max_positions or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if requested < 2:
        raise EngineError(f"max_model_len={requested}: needs >= 2 (a prompt and a token)")
    if max_positions is not None and requested > max_positions:
        raise EngineError(
            f"max_model_len={requested} exceeds the checkpoint's max_position_embeddings "
            f"{max_positions}; use at most {max_positions}"
        )
    return requested


def resolve_spec(
    draft: str | Path | None,
    spec_method: str | None,
    num_spec_tokens: int,
    proposer: Proposer | None,
) -> tuple[str | None, int]:
    """(spec method, K) for planning; a custom proposer plans like n-gram."""
    if draft is not None and spec_method not in (None, "draft", "eagle", "mtp"):
        raise EngineError(
            f"a draft folder goes with spec_method 'draft' (a model), 'eagle' (an EAGLE "
            f"head) or 'mtp' (an MTP head kept apart from the main checkpoint), not "
            f"{spec_method!r}"
        )
    if draft is None and spec_method in ("draft", "eagle"):
        what = "a draft model" if spec_method == "draft" else "an EAGLE head folder"
        raise EngineError(f"spec_method {spec_method!r} needs {what} (draft=FOLDER)")
    if proposer is not None and spec_method in HEAD_METHODS:
        raise EngineError(f"spec_method {spec_method!r} drafts with a head, not a proposer")
    if draft is not None and spec_method is None:
        spec_method = "draft"
    elif proposer is not None and spec_method is None:
        spec_method = "ngram"
    check_num_spec_tokens(num_spec_tokens)
    if spec_method is not None and num_spec_tokens < 1:
        raise EngineError(
            f"speculative decoding ({spec_method}) needs num_spec_tokens >= 1, got "
            f"{num_spec_tokens}"
        )
    if spec_method is None and num_spec_tokens:
        raise EngineError(f"num_spec_tokens={num_spec_tokens} needs a spec method or draft")
    return spec_method, num_spec_tokens


def resolve_ssm_dtype(layers: Iterable[LayerDesc], cache_dtype: DType) -> DType:
    """The models' ssm state dtype (a config may pin it, e.g. float32), else ours."""
    pinned = {d.ssm_dtype for d in layers if d.ssm_dtype is not None}
    if len(pinned) > 1:
        raise EngineError(f"state layers disagree on the ssm dtype: {sorted(map(str, pinned))}")
    return parse_dtype(str(pinned.pop())) if pinned else cache_dtype


def per_prompt_salts(
    cache_salt: str | Sequence[str | None] | None, num_prompts: int
) -> list[str | None]:
    """``generate``'s ``cache_salt`` as one salt (or None) per prompt."""
    if cache_salt is None or isinstance(cache_salt, str):
        return [cache_salt] * num_prompts
    if not isinstance(cache_salt, Sequence):
        raise EngineError(
            f"cache_salt must be a string, None, or one of those per prompt; got {cache_salt!r}"
        )
    salts = list(cache_salt)
    bad = [s for s in salts if s is not None and not isinstance(s, str)]
    if bad:
        raise EngineError(f"cache_salt entries must be strings or None; got {bad[:3]!r}")
    if len(salts) != num_prompts:
        raise EngineError(
            f"cache_salt has {len(salts)} entries for {num_prompts} prompts; give one salt "
            "per prompt, or a single string for all of them"
        )
    return salts


def parse_kv_dtype(name: str) -> DType:
    """``kv_dtype``: a cache dtype name (``fp8_e4m3``, ``fp8_e5m2``, ``bfloat16``...);
    "auto" means the model dtype and is handled by the caller passing None."""
    try:
        return parse_dtype(name)
    except SpecError as err:
        raise EngineError(f"kv_dtype {name!r}: {err}") from None


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a `torch.device` with its index ("cuda" -> "cuda:N", the current
    one); `EngineError` for an unknown device or CUDA on a machine without it."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise EngineError(f"device {device!r} is not a torch device: {err}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise EngineError(f"device {device!r}: the engine runs on cpu or cuda")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(f"device {device!r} asked for, but torch sees no CUDA device here")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if resolved.index is None else resolved.index
        if not 0 <= index < count:
            raise EngineError(f"device {device!r}: torch sees {count} CUDA device(s)")
        resolved = torch.device("cuda", index)  # "cuda" -> "cuda:0": tensors report that
    return resolved

"""Plan options shared by the CLI commands, with vLLM's flag names as aliases.

A vLLM command line carries over: ``--kv-cache-dtype``, ``--mamba-cache-dtype``,
``--mamba-ssm-cache-dtype``, ``--tensor-parallel-size``, ``--enable-prefix-caching``,
``--num-speculative-tokens``, ``--speculative-config JSON``,
``--gpu-memory-utilization`` with ``--gpu-memory``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from hybridkv.errors import HybridKVError, PlanError
from hybridkv.plan.types import PlanOptions
from hybridkv.spec.dtypes import DType, parse_dtype
from hybridkv.spec.model import ModelSpec

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(text: str, *, what: str = "--memory") -> int:
    """'80GiB', '60 GB', '1.5TiB', '123456' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise PlanError(f"{what}={text!r} is not a size; write e.g. 80GiB, 60GB or 1073741824")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _dtype(value: str | None, what: str) -> DType | None:
    if value is None or value.lower() == "auto":
        return None
    return parse_dtype(value, what=what)


Model = Annotated[str, typer.Argument(help="preset name, config.json, or a folder holding one")]
Draft = Annotated[str | None, typer.Option("--draft", help="draft model (preset or config)")]
SpecMethod = Annotated[
    str | None, typer.Option("--spec-method", help="draft | eagle | mtp | ngram | suffix")
]
NumSpec = Annotated[
    int, typer.Option("--num-spec", "--num-speculative-tokens", help="K: draft tokens per step")
]
SpecConfig = Annotated[
    str | None,
    typer.Option(
        "--speculative-config", help='vLLM style JSON: {"method","model","num_speculative_tokens"}'
    ),
]
KvDtype = Annotated[str, typer.Option("--kv-dtype", "--kv-cache-dtype", help="auto or a dtype")]
ConvDtype = Annotated[str, typer.Option("--conv-dtype", "--mamba-cache-dtype")]
SsmDtype = Annotated[str, typer.Option("--ssm-dtype", "--mamba-ssm-cache-dtype")]
Memory = Annotated[str | None, typer.Option("--memory", help="cache budget, e.g. 60GiB")]
GpuMemory = Annotated[
    str | None,
    typer.Option("--gpu-memory", help="device bytes; budget = this x --gpu-memory-utilization"),
]
GpuUtil = Annotated[float, typer.Option("--gpu-memory-utilization")]
Tp = Annotated[int, typer.Option("--tp", "--tensor-parallel-size")]
MaxLen = Annotated[int | None, typer.Option("--max-model-len")]
MaxSeqs = Annotated[int, typer.Option("--max-num-seqs")]
MaxBatched = Annotated[int, typer.Option("--max-num-batched-tokens")]
PrefixCaching = Annotated[
    bool,
    typer.Option(
        "--prefix-caching/--no-prefix-caching", "--enable-prefix-caching/--no-enable-prefix-caching"
    ),
]
StateMode = Annotated[
    str | None,
    typer.Option(
        "--state-mode",
        "--mamba-cache-mode",
        help="state checkpoints for prefix hits: align | all | none (vLLM's name works too)",
    ),
]
Layout = Annotated[str, typer.Option("--layout", help="auto | shared | split | vllm")]
BlockSize = Annotated[int | None, typer.Option("--block-size")]
MaxBlockSize = Annotated[
    int | None,
    typer.Option(
        "--max-block-size", help="cap on attention blocks (tokens): prefix-hit granularity"
    ),
]
TargetLen = Annotated[int | None, typer.Option("--target-len", help="default max_model_len")]
TypicalLen = Annotated[int | None, typer.Option("--typical-len")]
Json = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


def _normalize_method(method: str | None) -> str | None:
    """vLLM's method names (draft_model, eagle3, qwen3_next_mtp, ...) -> ours."""
    if method is None:
        return None
    name = method.lower()
    if name in ("draft_model", "draft"):
        return "draft"
    if name.startswith("eagle"):
        return "eagle"
    if name == "mtp" or name.endswith("_mtp"):
        return "mtp"
    return name  # ngram, suffix, or an unknown name the planner rejects with the list


@dataclass
class PlanArgs:
    """Raw CLI values for planning; `resolve` turns them into specs and options."""

    model: str
    draft: str | None = None
    spec_method: str | None = None
    num_spec: int = 0
    speculative_config: str | None = None
    kv_dtype: str = "auto"
    conv_dtype: str = "auto"
    ssm_dtype: str = "auto"
    memory: str | None = None
    gpu_memory: str | None = None
    gpu_memory_utilization: float = 0.9
    tp: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_caching: bool = True
    state_mode: str | None = None
    layout: str = "auto"
    block_size: int | None = None
    max_block_size: int | None = None
    target_len: int | None = None
    typical_len: int | None = None

    def _speculative(self) -> tuple[str | None, str | None, int]:
        method, draft, k = self.spec_method, self.draft, self.num_spec
        if self.speculative_config:
            try:
                config: dict[str, Any] = json.loads(self.speculative_config)
            except json.JSONDecodeError as err:
                raise PlanError(f"--speculative-config is not JSON: {err}") from err
            if not isinstance(config, dict):
                raise PlanError("--speculative-config must be a JSON object")
            method = config.get("method", method)
            draft = config.get("model", draft)
            k = int(config.get("num_speculative_tokens", k))
        if method is None and draft is not None:
            method = "draft"
        return _normalize_method(method), draft, k

    def _memory_bytes(self) -> int:
        if self.memory is not None:
            return parse_bytes(self.memory)
        if self.gpu_memory is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise PlanError(
                    f"--gpu-memory-utilization={self.gpu_memory_utilization} must be in (0, 1]"
                )
            return int(
                parse_bytes(self.gpu_memory, what="--gpu-memory") * self.gpu_memory_utilization
            )
        return PlanOptions().memory_bytes

    def resolve(self) -> tuple[ModelSpec, ModelSpec | None, PlanOptions]:
        from hybridkv.models import load_model_spec

        method, draft_name, k = self._speculative()
        main = load_model_spec(self.model)
        draft: ModelSpec | None = None
        if draft_name is not None:
            draft = load_model_spec(draft_name)
        elif method in ("mtp", "eagle"):
            draft = main.draft_head(method=method)
        if method is None and k:
            raise PlanError(f"--num-spec {k} needs --spec-method (or --draft)")
        options = PlanOptions(
            spec_method=method,
            num_spec_tokens=k,
            kv_dtype=_dtype(self.kv_dtype, "--kv-dtype"),
            conv_dtype=_dtype(self.conv_dtype, "--conv-dtype"),
            ssm_dtype=_dtype(self.ssm_dtype, "--ssm-dtype"),
            tp=self.tp,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefix_caching=self.prefix_caching,
            state_mode=self.state_mode,
            memory_bytes=self._memory_bytes(),
            block_size=self.block_size,
            max_block_size=self.max_block_size,
            layout=self.layout,
            target_len=self.target_len,
            typical_len=self.typical_len,
        )
        return main, draft, options


__all__ = ["HybridKVError", "PlanArgs", "parse_bytes"]

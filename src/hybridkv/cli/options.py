"""Plan options shared by the CLI commands, with vLLM's flag names as aliases.

A vLLM command line carries over: ``--kv-cache-dtype``, ``--mamba-cache-dtype``,
``--mamba-ssm-cache-dtype``, ``--tensor-parallel-size``, ``--enable-prefix-caching``,
``--num-speculative-tokens``, ``--speculative-config JSON``,
``--gpu-memory-utilization`` with ``--gpu-memory``.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Annotated

import typer

from hybridkv.errors import HybridKVError, PlanError
from hybridkv.plan.tree import TREE_KEYS, TokenTree, check_tree_drafts
from hybridkv.plan.types import MAX_SPEC_TOKENS, PlanOptions, check_num_spec_tokens
from hybridkv.spec.dtypes import DType, parse_dtype
from hybridkv.spec.model import ModelSpec

# Sizes: a number and a unit, nothing else guessed. K, M, G, T alone or with "iB" are
# binary (powers of 1024: "60G" = "60GiB", as docker and `free -g` read them); with "B"
# they are decimal (powers of 1000: "60GB" = 60 * 10^9). The prefix letter may be lower
# case ("512m", "8g"); the "B" may not: a lower-case "b" is a bit ("8Gb" is a gigabit), and
# reading it as bytes, binary or decimal, would be a guess, so it is refused.
_UNIT = re.compile(r"(?P<prefix>[KkMmGgTt])(?P<suffix>iB|B)?|B")
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}
# A bare number is read as bytes only when it is clearly a byte count: "--memory 60"
# almost always means 60 GiB, and planning for 60 bytes would only confuse.
MIN_BARE_BYTES = 1 << 20
MAX_BYTES = 1 << 50  # 1 PiB: far beyond any device, small enough for exact arithmetic
SIZE_FORMS = (
    "80GiB or 80G (binary, 2^30 bytes per G), 80GB (decimal, 10^9), likewise K, M, T "
    f"(KiB / K / KB ...), or a whole number of bytes >= {MIN_BARE_BYTES}"
)
SIZE_HELP = (
    "G/GiB = 2^30 bytes (binary), GB = 10^9 (decimal); likewise K, M, T; a lower-case b "
    f"(bits: Gb, gib) is refused; a bare number is bytes and must be >= {MIN_BARE_BYTES}"
)
DEFAULT_NUM_SPEC = 4  # K when a speculative method is given without --num-spec


def parse_bytes(text: str, *, what: str = "--memory") -> int:
    """'80GiB', '80G' (both binary), '60 GB' (decimal), '1.5TiB', '1073741824' -> bytes.

    Raises `PlanError` naming the accepted forms (`SIZE_FORMS`) for anything else: a unit
    in bits or unknown ('8Gb', '8gib', '8 parsecs'), a bare number under `MIN_BARE_BYTES`
    (write the unit), and sizes above `MAX_BYTES`.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match:
        raise PlanError(f"{what}={text!r} is not a size; write {SIZE_FORMS}")
    number, unit = match.group(1), match.group(2)
    if not unit:
        if not number.isdigit() or int(number) < MIN_BARE_BYTES:
            raise PlanError(
                f"{what}={text!r} has no unit (did you mean {number}GiB?); a bare number is "
                f"read as bytes and must be a whole number >= {MIN_BARE_BYTES}; write "
                f"{SIZE_FORMS}"
            )
        value = int(number)
    else:
        unit_match = _UNIT.fullmatch(unit)
        if unit_match is None:
            why = "a lower-case b is a bit, not a byte" if unit.endswith("b") else "unknown unit"
            raise PlanError(f"{what}={text!r}: {why} ({unit!r}); write {SIZE_FORMS}")
        prefix, suffix = unit_match.group("prefix"), unit_match.group("suffix")
        base = 1000 if suffix == "B" else 1024
        scale = 1 if prefix is None else base ** _POWER[prefix.lower()]
        value = int(float(number) * scale) if len(number) <= 20 else MAX_BYTES + 1
    if value > MAX_BYTES:
        raise PlanError(f"{what}={text!r} is {value} bytes, above the limit of {MAX_BYTES} (1PiB)")
    if value < 1:
        raise PlanError(f"{what}={text!r} is less than one byte; write {SIZE_FORMS}")
    return value


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
    int | None,
    typer.Option(
        "--num-spec",
        "--num-speculative-tokens",
        help=f"K: draft tokens per step (default {DEFAULT_NUM_SPEC} with a method, else 0)",
    ),
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
Memory = Annotated[
    str | None,
    typer.Option(
        "--memory", help=f"cache budget, e.g. 60GiB; default 64GiB. {SIZE_HELP}", show_default=False
    ),
]
GpuMemory = Annotated[
    str | None,
    typer.Option(
        "--gpu-memory", help="device memory (units as --memory); budget = this x utilization"
    ),
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


SPEC_CONFIG_KEYS = ("method", "model", "num_speculative_tokens")
# vLLM --speculative-config keys we know and refuse, with why: silently dropping them
# would plan something else than what was asked (a tree planned as a chain).
SPEC_CONFIG_UNSUPPORTED = {
    "draft_tensor_parallel_size": "a draft TP size different from --tp",
    "quantization": "draft quantization (weights do not change the cache plan)",
    "max_model_len": "a draft max_model_len (use --max-model-len for both)",
    "revision": "a draft revision",
    "code_revision": "a draft code revision",
    "disable_by_batch_size": "disabling drafts by batch size",
    "prompt_lookup_min": "n-gram lookup bounds (the cache only sees K)",
    "prompt_lookup_max": "n-gram lookup bounds (the cache only sees K)",
    "acceptance_method": "an acceptance method (the cache only sees accepted counts)",
    "parallel_drafting": "parallel drafting",
}


def speculative_tree(config: dict[str, object], method: str | None) -> TokenTree | None:
    """The token tree a ``--speculative-config`` asks for (``topk`` and
    ``num_speculative_tokens``, or ``speculative_token_tree`` as a list of rank paths or
    vLLM's string form ``"[(0,), (1,), (0, 0)]"``); None for a chain; `PlanError` for a
    tree the engine does not run (`hybridkv.plan.tree.check_tree_drafts`)."""
    keys = ", ".join(key for key in TREE_KEYS if key in config)
    raw = config.get("speculative_token_tree")
    try:
        if isinstance(raw, str):
            try:
                raw = ast.literal_eval(raw)
            except (ValueError, SyntaxError) as err:
                raise PlanError(
                    f"speculative_token_tree {raw!r} is not a list of paths: {err}"
                ) from None
        k = config.get("num_speculative_tokens")
        return check_tree_drafts(
            config.get("topk", 1),
            raw,
            num_spec_tokens=k if isinstance(k, int) and not isinstance(k, bool) else 0,
            method=_normalize_method(_str_or_none(config.get("method")) or method),
        )
    except PlanError as err:
        raise PlanError(f"--speculative-config: not supported: {keys}: {err}") from None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def parse_speculative_config(
    text: str, method: str | None, draft: str | None, k: int | None
) -> tuple[str | None, str | None, int | None]:
    """vLLM's ``--speculative-config`` JSON over the flags' (method, draft, K).

    Only ``method``, ``model`` and ``num_speculative_tokens`` are read, and ``topk`` /
    ``speculative_token_tree`` for a tree (planned as N speculative tokens, N = its node
    count; `speculative_tree`); any other key is refused by name
    (`SPEC_CONFIG_UNSUPPORTED` says why for vLLM's own keys)."""
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, ValueError, RecursionError) as err:
        raise PlanError(f"--speculative-config is not JSON: {err}") from None
    if not isinstance(config, dict):
        raise PlanError(
            f"--speculative-config must be a JSON object, got {type(config).__name__}; "
            '{"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 4}'
        )
    if any(key in config for key in TREE_KEYS):  # trees: planned as N speculative tokens
        tree = speculative_tree(config, method)
        config = {key: value for key, value in config.items() if key not in TREE_KEYS}
        if tree is not None:
            config["num_speculative_tokens"] = tree.num_nodes
    unsupported = [key for key in config if key in SPEC_CONFIG_UNSUPPORTED]
    if unsupported:
        why = "; ".join(f"{key}: {SPEC_CONFIG_UNSUPPORTED[key]}" for key in unsupported)
        raise PlanError(f"--speculative-config: not supported: {why}")
    unknown = sorted(set(config) - set(SPEC_CONFIG_KEYS))
    if unknown:
        raise PlanError(
            f"--speculative-config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"hybridkv reads {', '.join(SPEC_CONFIG_KEYS)}"
        )
    for key in ("method", "model"):
        value = config.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise PlanError(
                f"--speculative-config: {key!r} must be a non-empty string, got {value!r}"
            )
    if config.get("method") is not None:
        method = config["method"]
    if config.get("model") is not None:
        draft = config["model"]
    if "num_speculative_tokens" in config:
        value = config["num_speculative_tokens"]
        if value is None:
            raise PlanError(
                "--speculative-config: 'num_speculative_tokens' is null; give K, an integer "
                f"from 1 to {MAX_SPEC_TOKENS}"
            )
        check_num_spec_tokens(value, "--speculative-config num_speculative_tokens")
        k = value
    return method, draft, k


@dataclass
class PlanArgs:
    """Raw CLI values for planning; `resolve` turns them into specs and options."""

    model: str
    draft: str | None = None
    spec_method: str | None = None
    num_spec: int | None = None
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
    notes: list[str] = field(default_factory=list)  # said on stderr by the commands

    def _speculative(self) -> tuple[str | None, str | None, int]:
        method, draft, k = self.spec_method, self.draft, self.num_spec
        if self.speculative_config:
            method, draft, k = parse_speculative_config(self.speculative_config, method, draft, k)
        if method is None and draft is not None:
            method = "draft"
        method = _normalize_method(method)
        if k is None:
            k = 0
            if method is not None:
                # the same default as `hybridkv generate`, and said so (see `notes`)
                k = DEFAULT_NUM_SPEC
                self.notes.append(
                    f"--num-spec not given: K = {DEFAULT_NUM_SPEC} drafts per step (the "
                    "default of hybridkv generate); pass --num-spec K to change it"
                )
        check_num_spec_tokens(k, "--num-spec")
        return method, draft, k

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
        from hybridkv.demo import DEMO_CHECKPOINTS
        from hybridkv.models import load_model_spec

        method, draft_name, k = self._speculative()
        # `demo` / `demo-draft` (listed by `hybridkv models`) name the built-in folders
        main = load_model_spec(DEMO_CHECKPOINTS.get(self.model, self.model))
        draft: ModelSpec | None = None
        if draft_name is not None:
            draft = load_model_spec(DEMO_CHECKPOINTS.get(draft_name, draft_name))
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


__all__ = ["MAX_SPEC_TOKENS", "HybridKVError", "PlanArgs", "parse_bytes"]

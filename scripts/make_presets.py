"""Write the built-in presets (``src/hybridkv/models/presets/<name>.json``) from models.json.

Usage: ``python scripts/make_presets.py [--models PATH] [--out DIR]``. By default reads
``scripts/data/models.json`` (the model table, each entry with its sources). Each preset is an
HF-style ``config.json`` holding the fields the adapter reads, laid out the way the family's real
checkpoints state them (patterns as ``layer_types`` / ``hybrid_override_pattern`` /
``attn_layer_period`` ... built from the table's layer indices), plus a ``"_hybridkv"``
key with the name, hf_id, family, sources and notes. Entries that lack a number the
cache size depends on are skipped, with the reason printed. Rerun after editing
models.json; the output is deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = REPO / "scripts" / "data" / "models.json"
DEFAULT_OUT = REPO / "src" / "hybridkv" / "models" / "presets"

Entry = dict[str, Any]


class Insufficient(Exception):
    """The entry lacks a number the cache size depends on."""


def need(entry: Entry, *keys: str) -> None:
    missing = [k for k in keys if entry.get(k) is None]
    if missing:
        raise Insufficient(f"missing {', '.join(missing)}")


def base(entry: Entry) -> dict[str, Any]:
    need(entry, "num_hidden_layers", "hidden_size", "num_attention_heads")
    config = {
        "model_type": entry["model_type"],
        "hidden_size": entry["hidden_size"],
        "num_hidden_layers": entry["num_hidden_layers"],
        "num_attention_heads": entry["num_attention_heads"],
        "dtype": entry.get("default_dtype") or "bfloat16",
        "max_position_embeddings": entry.get("max_position_embeddings"),
    }
    for key in ("num_key_value_heads", "head_dim"):
        if entry.get(key) is not None:
            config[key] = entry[key]
    return config


def types_from_indices(entry: Entry, default: str, **kinds: str) -> list[str]:
    """Per-layer type names from the table's index lists (``kinds``: list key -> type)."""
    types = [default] * entry["num_hidden_layers"]
    for key, layer_type in kinds.items():
        for index in entry.get(key) or []:
            types[index] = layer_type
    return types


def attention(entry: Entry) -> dict[str, Any]:
    need(
        entry,
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    )
    return base(entry)


def sliding(entry: Entry) -> dict[str, Any]:
    need(entry, "sliding_window", "sliding_window_layer_indices")
    config = attention(entry)
    config["sliding_window"] = entry["sliding_window"]
    if entry.get("sliding_window_pattern"):
        config["sliding_window_pattern"] = entry["sliding_window_pattern"]
    config["layer_types"] = types_from_indices(
        entry, "full_attention", sliding_window_layer_indices="sliding_attention"
    )
    return config


def gdn(entry: Entry) -> dict[str, Any]:
    config = attention(entry)
    need(
        entry,
        "full_attention_interval",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    )
    for key in (
        "full_attention_interval",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    ):
        config[key] = entry[key]
    if entry["model_type"] == "qwen3_next":
        config["num_nextn_predict_layers"] = entry.get("mtp_num_layers") or 0
    else:  # Qwen3.5 checkpoints: mtp_num_hidden_layers and a float32 recurrent state.
        config["mtp_num_hidden_layers"] = entry.get("mtp_num_layers") or 0
        if "fp32" in (entry.get("ssm_state_dtype_hint") or ""):
            config["mamba_ssm_dtype"] = "float32"
    return config


def mamba_fields(entry: Entry) -> None:
    need(entry, "mamba_d_state", "mamba_d_conv")


def jamba(entry: Entry) -> dict[str, Any]:
    need(entry, "attn_layer_period", "attn_layer_offset", "mamba_expand")
    mamba_fields(entry)
    config = attention(entry)
    config.update(
        attn_layer_period=entry["attn_layer_period"],
        attn_layer_offset=entry["attn_layer_offset"],
        mamba_d_state=entry["mamba_d_state"],
        mamba_d_conv=entry["mamba_d_conv"],
        mamba_expand=entry["mamba_expand"],
    )
    return config


def nemotron_h(entry: Entry) -> dict[str, Any]:
    need(entry, "hybrid_override_pattern", "mamba_n_heads", "mamba_head_dim", "mamba_n_groups")
    mamba_fields(entry)
    config = attention(entry)
    config.update(
        hybrid_override_pattern=entry["hybrid_override_pattern"],
        ssm_state_size=entry["mamba_d_state"],
        mamba_num_heads=entry["mamba_n_heads"],
        mamba_head_dim=entry["mamba_head_dim"],
        n_groups=entry["mamba_n_groups"],
        conv_kernel=entry["mamba_d_conv"],
        expand=entry.get("mamba_expand") or 2,
        mamba_ssm_cache_dtype="float32",
        num_nextn_predict_layers=entry.get("mtp_num_layers") or 0,
    )
    return config


def falcon_h1(entry: Entry) -> dict[str, Any]:
    need(entry, "mamba_n_heads", "mamba_head_dim", "mamba_intermediate_size")
    mamba_fields(entry)
    config = attention(entry)
    # FalconH1Config defaults mamba_n_groups to 1; the table leaves it unset for some sizes.
    config.update(
        mamba_d_ssm=entry["mamba_intermediate_size"],
        mamba_n_heads=entry["mamba_n_heads"],
        mamba_d_head=entry["mamba_head_dim"],
        mamba_n_groups=entry.get("mamba_n_groups") or 1,
        mamba_d_state=entry["mamba_d_state"],
        mamba_d_conv=entry["mamba_d_conv"],
    )
    return config


def granite(entry: Entry) -> dict[str, Any]:
    need(
        entry,
        "mamba_n_heads",
        "mamba_head_dim",
        "mamba_n_groups",
        "mamba_expand",
        "full_attention_layer_indices",
    )
    mamba_fields(entry)
    config = attention(entry)
    config.update(
        layer_types=types_from_indices(entry, "mamba", full_attention_layer_indices="attention"),
        mamba_n_heads=entry["mamba_n_heads"],
        mamba_d_head=entry["mamba_head_dim"],
        mamba_n_groups=entry["mamba_n_groups"],
        mamba_d_state=entry["mamba_d_state"],
        mamba_d_conv=entry["mamba_d_conv"],
        mamba_expand=entry["mamba_expand"],
    )
    return config


def mamba2(entry: Entry) -> dict[str, Any]:
    need(entry, "mamba_n_heads", "mamba_head_dim", "mamba_n_groups", "mamba_expand")
    mamba_fields(entry)
    config = base(entry) if entry.get("num_attention_heads") else {}
    if not config:
        need(entry, "num_hidden_layers", "hidden_size")
        config = {
            "model_type": "mamba2",
            "hidden_size": entry["hidden_size"],
            "num_hidden_layers": entry["num_hidden_layers"],
            "dtype": entry.get("default_dtype") or "bfloat16",
            "max_position_embeddings": entry.get("max_position_embeddings"),
        }
    config.update(
        num_heads=entry["mamba_n_heads"],
        head_dim=entry["mamba_head_dim"],
        state_size=entry["mamba_d_state"],
        n_groups=entry["mamba_n_groups"],
        conv_kernel=entry["mamba_d_conv"],
        expand=entry["mamba_expand"],
    )
    return config


def lfm2(entry: Entry) -> dict[str, Any]:
    need(entry, "full_attention_layer_indices", "linear_conv_kernel_dim")
    config = attention(entry)
    config.update(
        full_attn_idxs=list(entry["full_attention_layer_indices"]),
        conv_L_cache=entry["linear_conv_kernel_dim"],
    )
    return config


def kimi_linear(entry: Entry) -> dict[str, Any]:
    need(
        entry,
        "kv_lora_rank",
        "qk_rope_head_dim",
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_conv_kernel_dim",
        "full_attention_layer_indices",
        "linear_or_ssm_layer_indices",
    )
    config = base(entry)
    config.pop("max_position_embeddings")
    config.update(
        model_max_length=entry.get("max_position_embeddings"),
        kv_lora_rank=entry["kv_lora_rank"],
        qk_rope_head_dim=entry["qk_rope_head_dim"],
        qk_nope_head_dim=entry.get("qk_nope_head_dim"),
        v_head_dim=entry.get("v_head_dim"),
        linear_attn_config={  # 1-based layer numbers, as in the checkpoint
            "full_attn_layers": [i + 1 for i in entry["full_attention_layer_indices"]],
            "kda_layers": [i + 1 for i in entry["linear_or_ssm_layer_indices"]],
            "num_heads": entry["linear_num_key_heads"],
            "head_dim": entry["linear_key_head_dim"],
            "short_conv_kernel_size": entry["linear_conv_kernel_dim"],
        },
    )
    return config


def minimax(entry: Entry) -> dict[str, Any]:
    need(entry, "full_attention_layer_indices")
    config = attention(entry)
    full = set(entry["full_attention_layer_indices"])
    config["attn_type_list"] = [int(i in full) for i in range(entry["num_hidden_layers"])]
    return config


def deepseek(entry: Entry) -> dict[str, Any]:
    need(entry, "kv_lora_rank", "qk_rope_head_dim")
    config = base(entry)
    config.update(
        kv_lora_rank=entry["kv_lora_rank"],
        qk_rope_head_dim=entry["qk_rope_head_dim"],
        qk_nope_head_dim=entry.get("qk_nope_head_dim"),
        v_head_dim=entry.get("v_head_dim"),
        num_nextn_predict_layers=entry.get("mtp_num_layers") or 0,
    )
    return config


BUILDERS: dict[str, Callable[[Entry], dict[str, Any]]] = {
    "llama": attention,
    "qwen3": attention,
    "qwen3_next": gdn,
    "qwen3_5_text": gdn,
    "gemma3_text": sliding,
    "gpt_oss": sliding,
    "jamba": jamba,
    "nemotron_h": nemotron_h,
    "falcon_h1": falcon_h1,
    "granitemoehybrid": granite,
    "mamba2": mamba2,
    "lfm2": lfm2,
    "kimi_linear": kimi_linear,
    "minimax_text_01": minimax,
    "deepseek_v2": deepseek,
    "deepseek_v3": deepseek,
}


def preset(entry: Entry) -> dict[str, Any]:
    builder = BUILDERS.get(entry.get("model_type", ""))
    if builder is None:
        raise Insufficient(f"no preset builder for model_type {entry.get('model_type')!r}")
    config = {k: v for k, v in builder(entry).items() if v is not None}
    config["_hybridkv"] = {
        "name": entry["name"].lower(),
        "hf_id": entry.get("hf_id", ""),
        "family": entry.get("family", ""),
        "confidence": entry.get("confidence", ""),
        "source": list(entry.get("source") or []),
        "notes": entry.get("notes") or "",
    }
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=DEFAULT_MODELS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    entries = json.loads(args.models.read_text(encoding="utf-8"))
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in entries:
        name = entry["name"].lower()
        try:
            config = preset(entry)
        except Insufficient as why:
            print(f"skip {name}: {why}", file=sys.stderr)
            continue
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
        written.append(name)
    print(f"wrote {len(written)} presets to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

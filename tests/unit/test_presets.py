"""Built-in presets against the model table (``scripts/data/models.json``).

Every table entry is a preset unless it lacks data (listed in ``SKIPPED``); each preset's
layer indices, context length, MTP count and the table's ``derived`` byte counts must
come out of the adapter + spec arithmetic unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridkv.errors import ConfigError
from hybridkv.models import decoder_layer_indices, list_presets, load_model_spec
from hybridkv.models.registry import load_config
from hybridkv.spec import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DType,
    ModelSpec,
    SlidingWindowSpec,
    StateSpec,
)

MODELS_JSON = Path(__file__).resolve().parents[2] / "scripts" / "data" / "models.json"
ENTRIES = json.loads(MODELS_JSON.read_text(encoding="utf-8"))

# Entries without enough data for a preset, and why (scripts/make_presets.py says the same).
SKIPPED = {
    "qwen3.5-2b": "layer count and head counts unknown",
    "qwen3.5-4b": "attention head counts unknown",
}
# Derived numbers that are the planner's business, not the adapter's.
PLANNER_KEYS = {
    "vllm_style_aligned_attn_block_tokens_bf16kv_align16",
    "vllm_style_aligned_attn_block_tokens_fp8kv_align16",
    "vllm_style_aligned_attn_block_tokens_bf16kv_align16_if_state_bf16",
}
BF16, FP32, FP8 = DType.BFLOAT16, DType.FLOAT32, DType.FP8_E4M3
PRESET_ENTRIES = [e for e in ENTRIES if e["name"].lower() not in SKIPPED]


def _attn(spec: ModelSpec) -> list:
    return [layer for layer in spec.layers if layer.grows_with_tokens]


def _states(spec: ModelSpec, conv: DType, ssm: DType) -> list[StateSpec]:
    return [
        layer.with_dtypes(conv=conv, ssm=ssm)
        for layer in spec.layers
        if isinstance(layer, StateSpec)
    ]


def _same(values: list[int]) -> int:
    assert values and len(set(values)) == 1, values
    return values[0]


def _kv_sum(spec: ModelSpec, kind: str | None) -> int:
    return sum(
        layer.with_dtypes(kv=BF16).bytes_per_token()
        for layer in _attn(spec)
        if kind is None or layer.kind == kind
    )


def _state_page(conv: DType, ssm: DType) -> Callable[[ModelSpec], int]:
    return lambda spec: _same([s.page_bytes() for s in _states(spec, conv, ssm)])


def _state_sum(conv: DType, ssm: DType) -> Callable[[ModelSpec], int]:
    return lambda spec: sum(s.page_bytes() for s in _states(spec, conv, ssm))


def _window_capped(spec: ModelSpec) -> int:
    return sum(
        layer.sliding_window * layer.with_dtypes(kv=BF16).bytes_per_token()
        for layer in spec.layers
        if isinstance(layer, SlidingWindowSpec)
    )


def _conv_growth(spec: ModelSpec) -> int:
    return _same([s.conv_bytes(1) - s.conv_bytes(0) for s in _states(spec, BF16, BF16)])


DERIVED: dict[str, Callable[[ModelSpec], int]] = {
    "attn_page_bytes_per_token_per_layer_bf16": lambda s: _same(
        [a.with_dtypes(kv=BF16).bytes_per_token() for a in _attn(s)]
    ),
    "attn_page_bytes_per_token_per_layer_fp8": lambda s: _same(
        [a.with_dtypes(kv=FP8).bytes_per_token() for a in _attn(s)]
    ),
    "kv_bytes_per_token_full_attention_layers_bf16": lambda s: _kv_sum(s, FULL_ATTENTION),
    "kv_bytes_per_token_sliding_layers_bf16": lambda s: _kv_sum(s, SLIDING_ATTENTION),
    "kv_bytes_per_token_all_attention_layers_bf16": lambda s: _kv_sum(s, None),
    "sliding_layers_kv_bytes_capped_at_window_bf16": _window_capped,
    "state_page_bytes_per_layer_conv_bf16_ssm_fp32": _state_page(BF16, FP32),
    "state_bytes_per_request_all_layers_ssm_fp32": _state_sum(BF16, FP32),
    "state_page_bytes_per_layer_conv_bf16_ssm_bf16": _state_page(BF16, BF16),
    "state_bytes_per_request_all_layers_ssm_bf16": _state_sum(BF16, BF16),
    "state_page_bytes_per_layer_conv_bf16_recurrent_fp32": _state_page(BF16, FP32),
    "state_bytes_per_request_all_layers": _state_sum(BF16, FP32),  # Kimi: fp32 recurrent
    "state_page_bytes_per_layer_bf16": _state_page(BF16, BF16),
    "state_bytes_per_request_all_layers_bf16": _state_sum(BF16, BF16),
    "state_page_bytes_per_layer_fp32": _state_page(BF16, FP32),
    "state_bytes_per_request_all_layers_fp32": _state_sum(BF16, FP32),
    "conv_state_growth_bytes_per_layer_per_spec_token_bf16": _conv_growth,
}
# (preset, derived key): where the table and our spec disagree on purpose, and why.
KNOWN_DIFFERENCES = {
    (
        "kimi-linear-48b-a3b-instruct",
        "conv_state_growth_bytes_per_layer_per_spec_token_bf16",
    ): "KDASpec keeps no extra conv rows for drafts; the table assumes every linear layer does",
}


def _derived_cases() -> list[tuple[str, str, int]]:
    cases = []
    for entry in PRESET_ENTRIES:
        for key, value in (entry.get("derived") or {}).items():
            if key.startswith("_") or key in PLANNER_KEYS or value is None:
                continue
            cases.append((entry["name"].lower(), key, value))
    return cases


def test_every_table_entry_is_a_preset_or_skipped_for_a_reason():
    names = {p.name for p in list_presets()}
    expected = {e["name"].lower() for e in PRESET_ENTRIES}
    assert names == expected
    assert {e["name"].lower() for e in ENTRIES} - names == set(SKIPPED)


def test_every_derived_key_is_checked():
    keys = {k for e in ENTRIES for k in (e.get("derived") or {}) if not k.startswith("_")}
    assert keys - PLANNER_KEYS <= set(DERIVED)


def test_preset_names_are_case_insensitive():
    assert load_model_spec("Qwen3-Next-80B-A3B-Instruct") == load_model_spec(
        "qwen3-next-80b-a3b-instruct"
    )


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="qwen3-4b"):
        load_model_spec("no-such-model")


def test_list_presets_fields():
    info = {p.name: p for p in list_presets()}["qwen3.5-9b"]
    assert (info.family, info.model_type, info.hf_id) == (
        "qwen3.5",
        "qwen3_5_text",
        "Qwen/Qwen3.5-9B",
    )
    assert info.layer_mix == "8 full_attention, 24 state:gated_delta_net"
    assert info.source


@pytest.mark.parametrize("entry", PRESET_ENTRIES, ids=lambda e: e["name"].lower())
def test_preset_matches_table(entry):
    name = entry["name"].lower()
    spec = load_model_spec(name)
    config, _ = load_config(name)
    indices = decoder_layer_indices(config)
    attn_at = [i for i, layer in zip(indices, spec.layers, strict=True) if layer.grows_with_tokens]
    full_at = [
        i
        for i, layer in zip(indices, spec.layers, strict=True)
        if layer.kind in (FULL_ATTENTION, "mla")
    ]
    state_at = [
        i for i, layer in zip(indices, spec.layers, strict=True) if isinstance(layer, StateSpec)
    ]
    sliding_at = sorted(set(attn_at) - set(full_at))
    assert full_at == entry["full_attention_layer_indices"]
    assert state_at == (entry.get("linear_or_ssm_layer_indices") or [])
    assert sliding_at == (entry.get("sliding_window_layer_indices") or [])
    assert spec.name == name
    assert spec.max_position_embeddings == entry["max_position_embeddings"]
    assert spec.num_mtp_layers == (entry.get("mtp_num_layers") or 0)
    assert spec.dtype == DType.BFLOAT16


@pytest.mark.parametrize(
    ("name", "key", "expected"), _derived_cases(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_derived_numbers(name, key, expected):
    spec = load_model_spec(name)
    got = DERIVED[key](spec)
    if (name, key) in KNOWN_DIFFERENCES:
        assert got != expected, f"fixed? drop KNOWN_DIFFERENCES entry: {KNOWN_DIFFERENCES}"
        return
    assert got == expected


# How a number was found is not where it comes from: a source names the public config,
# card or report (by name or URL) and says whether the numbers were checked against it.
RESEARCH_NOTES = (
    "session",
    "find_string",
    "recollection",
    "index id",
    "search hit",
    "corpus",
    "found via",
    "believed",
    "re-read",
)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"].lower())
def test_sources_say_where_numbers_come_from_not_how_they_were_found(entry):
    texts = [*entry.get("source", []), entry.get("notes") or ""]
    name = entry["name"].lower()
    if name not in SKIPPED:  # what `hybridkv models` shows is the generated preset
        meta = load_config(name)[0]["_hybridkv"]
        texts += [*meta["source"], meta["notes"]]
    for text in texts:
        lowered = text.lower()
        assert not [w for w in RESEARCH_NOTES if w in lowered], (name, text)

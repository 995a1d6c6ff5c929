"""Adapters against transformers itself: configs built with each family's own config class.

For every supported ``model_type`` a tiny config is built with ``transformers``' config
class and ``.to_dict()``; the layer kinds must follow the per-layer pattern transformers
builds (``config.layer_types`` / ``layers_block_type``, which the modeling code reads per
layer) and the byte sizes must match hand-computed numbers. ``minimax_text_01`` has no
transformers config class, so its dict is written by hand.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import transformers as tf

from hybridkv.errors import ConfigError
from hybridkv.models import (
    decoder_layer_indices,
    from_hf_config,
    load_model_spec,
    supported_model_types,
)
from hybridkv.spec import (
    AttentionSpec,
    DType,
    GatedDeltaNetSpec,
    ModelSpec,
    SlidingWindowSpec,
    StateSpec,
)

ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
FULL, SLIDING = "full_attention", "sliding_attention"


def cfg(cls: str, **kwargs: Any) -> dict[str, Any]:
    return getattr(tf, cls)(**kwargs).to_dict()


def kinds(spec: ModelSpec) -> list[str]:
    return [f"state:{x.family}" if isinstance(x, StateSpec) else x.kind for x in spec.layers]


def expected(types: list[str], state: str | None = None) -> list[str]:
    """Our kinds for transformers' per-layer types; MLP / MoE layers hold no cache."""
    table = {
        FULL: [FULL],
        SLIDING: [SLIDING],
        "mlp": [],
        "moe": [],
        "attention": [FULL],
        "linear_attention": [f"state:{state}"],
        "mamba": [f"state:{state}"],
        "conv": [f"state:{state}"],
    }
    return [kind for t in types for kind in table[t]]


def check(model_type: str, config: dict[str, Any], kinds_expected: list[str]) -> ModelSpec:
    """Adapt ``config``; its resolved type must be ``model_type`` (or that wrapper's text)."""
    spec = from_hf_config(config)
    assert model_type in (config["model_type"], spec.model_type)
    assert kinds(spec) == kinds_expected
    return spec


# --------------------------------------------------------------------------- dense


def test_llama():
    spec = check("llama", cfg("LlamaConfig", num_hidden_layers=3, **ATTN), [FULL] * 3)
    layer = spec.layers[0]
    assert (layer.num_kv_heads, layer.head_dim) == (2, 16)  # head_dim = 64 // 4
    assert layer.bytes_per_token() == 2 * (16 + 16) * 2
    assert spec.dtype == DType.BFLOAT16


def test_mistral_global_window_applies_to_every_layer():
    spec = check(
        "mistral",
        cfg("MistralConfig", num_hidden_layers=3, sliding_window=32, **ATTN),
        [SLIDING] * 3,
    )
    assert spec.layers[0].sliding_window == 32
    no_window = from_hf_config(
        cfg("MistralConfig", num_hidden_layers=2, sliding_window=None, **ATTN)
    )
    assert kinds(no_window) == [FULL] * 2


def test_layer_types_win_over_global_sliding_window():
    config = cfg("MistralConfig", num_hidden_layers=3, sliding_window=32, **ATTN)
    config["layer_types"] = [FULL, SLIDING, FULL]
    assert kinds(from_hf_config(config)) == [FULL, SLIDING, FULL]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_max_window_layers(model_type):
    cls = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[model_type]
    config = getattr(tf, cls)(
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=2,
        head_dim=32,
        **ATTN,
    )
    spec = check(model_type, config.to_dict(), expected(config.layer_types))
    assert kinds(spec) == [FULL, FULL, SLIDING, SLIDING]
    assert spec.layers[3].sliding_window == 16 and spec.layers[0].head_dim == 32
    raw = config.to_dict()
    del raw["layer_types"]  # the rule alone gives the same pattern
    raw["sliding_window"] = 16
    assert kinds(from_hf_config(raw)) == kinds(spec)


def test_qwen3_head_dim_defaults_to_128_and_window_needs_use_sliding_window():
    raw = cfg("Qwen3Config", num_hidden_layers=2, **ATTN)
    del raw["head_dim"], raw["layer_types"]
    raw.update(sliding_window=16, use_sliding_window=False, max_window_layers=0)
    spec = from_hf_config(raw)
    assert kinds(spec) == [FULL, FULL] and spec.layers[0].head_dim == 128


def test_qwen3_moe_window_on_every_layer():
    spec = check(
        "qwen3_moe",
        cfg(
            "Qwen3MoeConfig", num_hidden_layers=2, use_sliding_window=True, sliding_window=8, **ATTN
        ),
        [SLIDING] * 2,
    )
    assert spec.layers[0].head_dim == 16  # getattr(config, "head_dim", hidden // heads)


def test_gemma3_nested_text_config_and_pattern():
    text = dict(
        num_hidden_layers=7, sliding_window=8, sliding_window_pattern=3, head_dim=32, **ATTN
    )
    config = tf.Gemma3Config(text_config=text)
    spec = check("gemma3", config.to_dict(), expected(config.text_config.layer_types))
    assert kinds(spec) == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING]
    assert spec.model_type == "gemma3_text"
    assert isinstance(spec.layers[0], SlidingWindowSpec) and spec.layers[0].sliding_window == 8
    raw = config.text_config.to_dict()
    del raw["layer_types"]
    raw["sliding_window_pattern"] = 3
    assert kinds(check("gemma3_text", raw, kinds(spec))) == kinds(spec)


def test_gpt_oss_alternates():
    config = tf.GptOssConfig(num_hidden_layers=4, sliding_window=16, head_dim=8, **ATTN)
    spec = check("gpt_oss", config.to_dict(), expected(config.layer_types))
    assert kinds(spec) == [SLIDING, FULL, SLIDING, FULL]
    assert spec.layers[0].bytes_per_token() == 2 * (8 + 8) * 2


# --------------------------------------------------------------------------- qwen hybrids

GDN = dict(
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=3,
    **ATTN,
)
# conv (2*2*8 + 4*16) channels x 2 rows x 2 B = 384; ssm 4 x 16 x 8 x 2 B = 1024.
GDN_BF16_PAGE, GDN_FP32_PAGE = 384 + 1024, 384 + 2048


def test_qwen3_next_interval_and_sizes():
    config = tf.Qwen3NextConfig(num_hidden_layers=6, full_attention_interval=2, **GDN)
    spec = check("qwen3_next", config.to_dict(), expected(config.layer_types, "gated_delta_net"))
    assert kinds(spec)[:2] == ["state:gated_delta_net", FULL]
    attn, gdn = spec.layers[1], spec.layers[0]
    assert isinstance(attn, AttentionSpec) and attn.gated and attn.bytes_per_token() == 128
    assert isinstance(gdn, GatedDeltaNetSpec) and gdn.page_bytes() == GDN_BF16_PAGE
    assert gdn.conv_bytes(2) - gdn.conv_bytes(0) == 2 * 96 * 2  # one row per draft token
    raw = config.to_dict()
    del raw["layer_types"]
    raw["full_attention_interval"] = 2
    assert kinds(from_hf_config(raw)) == kinds(spec)


@pytest.mark.parametrize(
    ("wrapper", "text_cls"),
    [("qwen3_5", "Qwen3_5TextConfig"), ("qwen3_5_moe", "Qwen3_5MoeTextConfig")],
)
def test_qwen3_5_wrapper_and_text(wrapper, text_cls):
    wrapper_cls = {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig"}[wrapper]
    text = dict(num_hidden_layers=8, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1, **GDN)
    config = getattr(tf, wrapper_cls)(text_config=text)
    spec = check(
        wrapper, config.to_dict(), expected(config.text_config.layer_types, "gated_delta_net")
    )
    assert spec.model_type == f"{wrapper}_text" and spec.num_mtp_layers == 1
    assert spec.layers[0].page_bytes() == GDN_FP32_PAGE  # mamba_ssm_dtype float32
    assert spec.layers[0].conv_dtype == DType.BFLOAT16
    flat = getattr(tf, text_cls)(**text)
    assert kinds(check(f"{wrapper}_text", flat.to_dict(), kinds(spec))) == kinds(spec)


# --------------------------------------------------------------------------- mamba hybrids


def test_jamba_period_offset_mamba1():
    config = tf.JambaConfig(
        num_hidden_layers=6,
        attn_layer_period=3,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        **ATTN,
    )
    spec = check("jamba", config.to_dict(), expected(config.layers_block_type, "mamba1"))
    assert kinds(spec)[:3] == ["state:mamba1", FULL, "state:mamba1"]
    # intermediate 2 * 64 = 128: conv 128 x 3 x 2 B = 768, ssm 128 x 8 x 2 B = 2048.
    assert spec.layers[0].page_bytes() == 768 + 2048
    assert spec.layers[0].page_bytes(num_spec_tokens=3) == 768 + 2048  # Mamba1: no draft rows


NEMOTRON = dict(
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    head_dim=16,
    **ATTN,
)


def test_nemotron_h_pattern_skips_mlp_and_moe():
    config = tf.NemotronHConfig(hybrid_override_pattern="M-M*E-", **NEMOTRON)
    spec = check("nemotron_h", config.to_dict(), expected(config.layers_block_type, "mamba2"))
    assert kinds(spec) == ["state:mamba2", "state:mamba2", FULL]
    assert decoder_layer_indices(config.to_dict()) == (0, 2, 3)
    # conv (32 + 2*2*16) x 3 x 2 B = 576; ssm 4 x 8 x 16 x 4 B (mamba_ssm_cache_dtype fp32).
    assert spec.layers[0].page_bytes() == 576 + 2048
    raw = config.to_dict()
    del raw["layers_block_type"]
    raw.update(hybrid_override_pattern="M-M*E-", mamba_n_groups=1)  # legacy name wins
    assert decoder_layer_indices(raw) == (0, 2, 3)
    assert from_hf_config(raw).layers[0].n_groups == 1


def test_falcon_h1_two_specs_per_layer():
    config = tf.FalconH1Config(
        num_hidden_layers=2,
        mamba_d_ssm=96,
        mamba_n_heads=6,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        **ATTN,
    )
    spec = check(
        "falcon_h1",
        config.to_dict(),
        [k for t in config.layers_block_type for k in (FULL, "state:mamba2") if t == "hybrid"],
    )
    assert decoder_layer_indices(config.to_dict()) == (0, 0, 1, 1)
    mamba = spec.layers[1]
    assert (mamba.num_heads, mamba.head_dim) == (6, 16)  # "auto": 96 // 6
    # conv (96 + 2*2*8) x 3 x 2 B = 768; ssm 6 x 16 x 8 x 2 B = 1536.
    assert mamba.page_bytes() == 768 + 1536


@pytest.mark.parametrize(("position", "rope"), [("nope", False), (None, False), ("rope", True)])
def test_granite_layer_types_and_nope(position, rope):
    config = tf.GraniteMoeHybridConfig(
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        position_embedding_type=position,
        mamba_n_heads=8,
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        **ATTN,
    )
    spec = check("granitemoehybrid", config.to_dict(), expected(config.layer_types, "mamba2"))
    assert kinds(spec) == ["state:mamba2", FULL, "state:mamba2", "state:mamba2"]
    assert spec.layers[1].use_rope is rope
    # intermediate 128, head 16: conv (128 + 32) x 3 x 2 B = 960; ssm 8 x 16 x 16 x 2 B.
    assert spec.layers[0].page_bytes() == 960 + 4096


def test_mamba2_all_layers():
    config = tf.Mamba2Config(
        num_hidden_layers=3,
        num_heads=8,
        head_dim=16,
        hidden_size=64,
        expand=2,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
    )
    spec = check("mamba2", config.to_dict(), expected(config.layer_types, "mamba2"))
    assert spec.layers[0].page_bytes() == (128 + 64) * 3 * 2 + 8 * 16 * 16 * 2


# --------------------------------------------------------------------------- others


def test_lfm2_conv_layers():
    config = tf.Lfm2Config(num_hidden_layers=5, full_attn_idxs=[1, 3], conv_L_cache=3, **ATTN)
    spec = check("lfm2", config.to_dict(), expected(config.layer_types, "short_conv"))
    assert kinds(spec)[:2] == ["state:short_conv", FULL]
    assert spec.layers[0].page_bytes() == 64 * 2 * 2  # hidden x (L_cache - 1) x 2 B
    raw = config.to_dict()
    del raw["layer_types"]
    assert kinds(from_hf_config(raw)) == kinds(spec)


def test_kimi_linear_kda_and_mla():
    linear = {
        "full_attn_layers": [2, 5],
        "kda_layers": [1, 3, 4],
        "num_heads": 2,
        "head_dim": 8,
        "short_conv_kernel_size": 4,
    }
    config = tf.KimiLinearConfig(
        num_hidden_layers=5, linear_attn_config=linear, kv_lora_rank=32, qk_rope_head_dim=8, **ATTN
    )
    spec = check(
        "kimi_linear",
        config.to_dict(),
        [{"full_attention": "mla", "linear_attention": "state:kda"}[t] for t in config.layer_types],
    )
    assert kinds(spec) == ["state:kda", "mla", "state:kda", "state:kda", "mla"]
    assert spec.layers[1].bytes_per_token() == (32 + 8) * 2
    # conv 3 x 2 x 8 channels x 3 rows x 2 B = 288; recurrent 2 x 8 x 8 x 4 B (fp32) = 512.
    assert spec.layers[0].page_bytes() == 288 + 512
    raw = config.to_dict()
    del raw["layer_types"]
    raw["linear_attn_config"] = linear
    assert kinds(from_hf_config(raw)) == kinds(spec)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_mla(model_type):
    cls = {"deepseek_v3": "DeepseekV3Config", "deepseek_v2": "DeepseekV2Config"}[model_type]
    spec = check(
        model_type,
        cfg(cls, num_hidden_layers=3, kv_lora_rank=32, qk_rope_head_dim=8, **ATTN),
        ["mla"] * 3,
    )
    assert spec.layers[0].page_bytes(16) == 16 * (32 + 8) * 2
    assert spec.num_mtp_layers == (1 if model_type == "deepseek_v3" else 0)


def test_minimax_lightning():
    config = tf.MiniMaxConfig(num_hidden_layers=4, head_dim=16, **ATTN)
    spec = check("minimax", config.to_dict(), expected(config.layer_types, "lightning"))
    assert spec.layers[1].page_bytes() == 4 * 16 * 16 * 2  # heads x d x d, no conv


def test_minimax_text_01_attn_type_list():
    """No transformers config class for ``minimax_text_01``: the dict is MiniMax-Text-01's
    own layout (``attn_type_list``: 0 lightning, 1 softmax), written by hand."""
    config = {
        "model_type": "minimax_text_01",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "attn_type_list": [0, 1, 0, 1],
        "torch_dtype": "bfloat16",
        **ATTN,
    }
    spec = check("minimax_text_01", config, ["state:lightning", FULL] * 2)
    assert spec.layers[1].head_dim == 16


# model_type -> the test above that builds it with transformers (or by hand, documented).
TESTED = {
    "llama": test_llama,
    "mistral": test_mistral_global_window_applies_to_every_layer,
    "qwen2": test_qwen_max_window_layers,
    "qwen3": test_qwen_max_window_layers,
    "qwen3_moe": test_qwen3_moe_window_on_every_layer,
    "gemma3": test_gemma3_nested_text_config_and_pattern,
    "gemma3_text": test_gemma3_nested_text_config_and_pattern,
    "gpt_oss": test_gpt_oss_alternates,
    "qwen3_next": test_qwen3_next_interval_and_sizes,
    "qwen3_5": test_qwen3_5_wrapper_and_text,
    "qwen3_5_text": test_qwen3_5_wrapper_and_text,
    "qwen3_5_moe": test_qwen3_5_wrapper_and_text,
    "qwen3_5_moe_text": test_qwen3_5_wrapper_and_text,
    "jamba": test_jamba_period_offset_mamba1,
    "nemotron_h": test_nemotron_h_pattern_skips_mlp_and_moe,
    "falcon_h1": test_falcon_h1_two_specs_per_layer,
    "granitemoehybrid": test_granite_layer_types_and_nope,
    "mamba2": test_mamba2_all_layers,
    "lfm2": test_lfm2_conv_layers,
    "kimi_linear": test_kimi_linear_kda_and_mla,
    "deepseek_v3": test_deepseek_mla,
    "deepseek_v2": test_deepseek_mla,
    "minimax": test_minimax_lightning,
    "minimax_text_01": test_minimax_text_01_attn_type_list,
}


def test_every_supported_model_type_is_tested():
    assert set(supported_model_types()) == set(TESTED)


# --------------------------------------------------------------------------- errors, io


def test_unknown_model_type_lists_supported_types():
    with pytest.raises(ConfigError, match=r"'bert'.*gemma3.*qwen3_next"):
        from_hf_config({"model_type": "bert"})


def test_missing_field_is_named():
    raw = cfg("Qwen3Config", num_hidden_layers=2, **ATTN)
    del raw["num_hidden_layers"]
    with pytest.raises(ConfigError, match="'num_hidden_layers' is missing"):
        from_hf_config(raw)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("num_key_value_heads", "eight", "'num_key_value_heads' must be a positive integer"),
        ("layer_types", [FULL], "'layer_types' lists 1 layers"),
        ("layer_types", ["cross_attention"] * 2, "unknown layer types 'cross_attention'"),
        ("dtype", "int4", "'dtype' is not a dtype"),
    ],
)
def test_malformed_field_is_named(key, value, match):
    raw = cfg("Qwen3Config", num_hidden_layers=2, **ATTN)
    raw[key] = value
    with pytest.raises(ConfigError, match=match):
        from_hf_config(raw)


def test_bad_nemotron_pattern_and_missing_text_config():
    with pytest.raises(ConfigError, match="hybrid_override_pattern"):
        from_hf_config({"model_type": "nemotron_h", "hybrid_override_pattern": "M*X", **ATTN})
    with pytest.raises(ConfigError, match="'text_config' is missing"):
        from_hf_config({"model_type": "gemma3"})


def test_dtypes_from_config():
    raw = cfg("LlamaConfig", num_hidden_layers=1, **ATTN)
    raw.update(dtype=None, torch_dtype="float16")
    assert from_hf_config(raw).layers[0].dtype == DType.FLOAT16
    raw["dtype"] = "float32"
    spec = from_hf_config(raw)
    assert spec.dtype == DType.FLOAT32 and spec.layers[0].dtype == DType.FLOAT32


def test_load_from_file_folder_and_dict(tmp_path):
    raw = cfg("Qwen3Config", num_hidden_layers=2, **ATTN)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    by_folder = load_model_spec(tmp_path)
    by_file = load_model_spec(str(tmp_path / "config.json"))
    assert by_folder.layers == by_file.layers == load_model_spec(raw).layers
    assert by_file.source.endswith("config.json")
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_spec(tmp_path / "bad.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no config\.json"):
        load_model_spec(tmp_path / "empty")

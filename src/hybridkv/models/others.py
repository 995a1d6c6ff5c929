"""LFM2 (short conv), Kimi Linear (KDA + MLA), MiniMax (lightning + softmax), DeepSeek MLA.

Layer rules, from each transformers config class:

* LFM2: ``layer_types`` (``full_attention`` / ``conv``), else full attention at the
  indices ``full_attn_idxs`` (default: every layer) and short conv elsewhere. The conv
  state keeps ``conv_L_cache - 1`` rows of ``hidden_size`` channels.
* Kimi Linear: ``layer_types``, else ``linear_attn_config.full_attn_layers`` /
  ``kda_layers`` (1-based in checkpoints), else full attention when ``i and i % 4 == 0``.
  Full-attention layers are MLA (``kv_lora_rank + qk_rope_head_dim`` per token); KDA
  layers keep q, k, v short-conv rows and an fp32 ``heads x d x d`` state.
* MiniMax: ``layer_types``, else MiniMax-Text-01's ``attn_type_list`` (0 lightning,
  1 softmax), else ``MiniMaxConfig``'s rule (full when ``(i + 1) % 2``). A global
  ``sliding_window`` applies to the softmax layers (modeling_minimax). Lightning layers
  keep a ``num_attention_heads x head_dim x head_dim`` state.
* DeepSeek V2 / V3: every layer MLA; V3 counts ``num_nextn_predict_layers`` MTP layers
  (default 1 in ``DeepseekV3Config``).
"""

from __future__ import annotations

from typing import Any

from hybridkv.models._fields import (
    Adapter,
    ConfigReader,
    IndexedLayers,
    build_layers,
    head_dim_or_ratio,
)
from hybridkv.models.dense import attention_spec
from hybridkv.spec.layers import KDASpec, LightningSpec, MLASpec, ShortConvSpec

HYBRID_TYPES = ("full_attention", "linear_attention")


def _int_list(r: ConfigReader, key: str, values: Any) -> list[int]:
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise r.error(key, f"must be a list of layer indices, got {values!r}")
    return values


def lfm2(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    types = r.layer_types(("layer_types",), n, ("full_attention", "conv"))
    if types is None:
        listed = r.get_list("full_attn_idxs")
        full = set(range(n)) if listed is None else set(_int_list(r, "full_attn_idxs", listed))
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    attn = attention_spec(r, head_dim=head_dim_or_ratio(r))
    conv = ShortConvSpec(
        hidden_size=r.get_int("hidden_size"),
        conv_l_cache=r.get_int("conv_L_cache"),
        conv_dtype=r.dtype,
        ssm_dtype=r.ssm_dtype,
    )
    return build_layers(types, {"full_attention": lambda i: [attn], "conv": lambda i: [conv]})


def _mla(r: ConfigReader) -> MLASpec:
    return MLASpec(
        kv_lora_rank=r.get_int("kv_lora_rank"),
        qk_rope_head_dim=r.get_int("qk_rope_head_dim"),
        dtype=r.dtype,
    )


def _kimi_types(r: ConfigReader, n: int, linear: dict[str, Any]) -> list[str]:
    types = r.layer_types(("layer_types",), n, HYBRID_TYPES)
    if types is not None:
        return types
    if "full_attn_layers" in linear and "kda_layers" in linear:
        slots: list[str | None] = [None] * n
        for key, kind in (
            ("full_attn_layers", "full_attention"),
            ("kda_layers", "linear_attention"),
        ):
            for one_based in _int_list(r, f"linear_attn_config.{key}", linear[key]):
                if not 1 <= one_based <= n:
                    raise r.error(
                        f"linear_attn_config.{key}", f"names layer {one_based}, outside 1..{n}"
                    )
                slots[one_based - 1] = kind
        missing = [i + 1 for i, t in enumerate(slots) if t is None]
        if missing:
            raise r.error("linear_attn_config", f"leaves layers {missing} (1-based) untyped")
        return [t for t in slots if t is not None]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def kimi_linear(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    linear = r.config.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise r.error("linear_attn_config", f"must be an object, got {linear!r}")
    # KimiLinearConfig.__post_init__: linear_attn_config entries win over the flat fields.
    sub = ConfigReader(
        {
            "num_heads": linear.get("num_heads", r.get_int("linear_num_heads")),
            "head_dim": linear.get("head_dim", r.get_int("linear_head_dim")),
            "kernel": linear.get("short_conv_kernel_size", r.get_int("linear_conv_kernel_dim")),
        },
        f"{r.model_type} linear_attn_config",
    )
    kda = KDASpec(
        num_heads=sub.get_int("num_heads"),
        head_dim=sub.get_int("head_dim"),
        conv_kernel=sub.get_int("kernel"),
        conv_dtype=r.dtype,
        ssm_dtype=r.ssm_dtype,
    )
    mla = _mla(r)
    return build_layers(
        _kimi_types(r, n, linear),
        {"full_attention": lambda i: [mla], "linear_attention": lambda i: [kda]},
    )


def minimax(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    types = r.layer_types(("layer_types",), n, HYBRID_TYPES)
    if types is None and r.has("attn_type_list"):
        codes = _int_list(r, "attn_type_list", r.get_list("attn_type_list"))
        if len(codes) != n or set(codes) - {0, 1}:
            raise r.error("attn_type_list", f"must list 0 or 1 for each of {n} layers")
        types = ["full_attention" if c == 1 else "linear_attention" for c in codes]
    if types is None:
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
    head_dim = head_dim_or_ratio(r)
    attn = attention_spec(r, head_dim=head_dim, window=r.get_optional_int("sliding_window"))
    lightning = LightningSpec(
        num_heads=r.get_int("num_attention_heads"),
        head_dim=head_dim,
        conv_dtype=r.dtype,
        ssm_dtype=r.ssm_dtype,
    )
    return build_layers(
        types, {"full_attention": lambda i: [attn], "linear_attention": lambda i: [lightning]}
    )


def deepseek(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    mla = _mla(r)
    return [(i, mla) for i in range(n)]


_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
_MINIMAX = {"num_key_value_heads": 8}

ADAPTERS: dict[str, Adapter] = {
    "lfm2": Adapter("lfm2", lfm2, {"conv_L_cache": 3, "num_key_value_heads": 8}),
    "kimi_linear": Adapter(
        "kimi-linear",
        kimi_linear,
        {
            **_MLA,
            "linear_head_dim": 128,
            "linear_num_heads": 32,
            "linear_conv_kernel_dim": 4,
        },
    ),
    "minimax": Adapter("minimax", minimax, _MINIMAX),
    "minimax_text_01": Adapter("minimax", minimax, _MINIMAX),
    "deepseek_v2": Adapter("deepseek", deepseek, _MLA),
    "deepseek_v3": Adapter("deepseek", deepseek, {**_MLA, "num_nextn_predict_layers": 1}),
}

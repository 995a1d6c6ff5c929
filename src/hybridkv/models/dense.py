"""Attention-only families: Llama, Mistral, Qwen2/3 (dense and MoE), Gemma 3, gpt-oss.

Each decoder layer holds one KV cache, full or sliding-window. Where a config lists
``layer_types`` those win over any global ``sliding_window``; otherwise each family's
own rule decides (cited per adapter from ``transformers`` 5.x). A layer typed
``sliding_attention`` whose window resolves to null is full attention, as the modeling
code then passes ``sliding_window=None``.
"""

from __future__ import annotations

from hybridkv.models._fields import (
    Adapter,
    ConfigReader,
    IndexedLayers,
    build_layers,
    head_dim_or_ratio,
    num_kv_heads,
)
from hybridkv.spec.layers import AttentionSpec, SlidingWindowSpec

ATTENTION_TYPES = ("full_attention", "sliding_attention")


def attention_spec(
    r: ConfigReader,
    *,
    head_dim: int,
    window: int | None = None,
    gated: bool = False,
    use_rope: bool = True,
) -> AttentionSpec:
    """One attention layer's KV spec in the model dtype; a window makes it sliding."""
    common = dict(
        num_kv_heads=num_kv_heads(r),
        head_dim=head_dim,
        dtype=r.dtype,
        gated=gated,
        use_rope=use_rope,
    )
    if window is None:
        return AttentionSpec(**common)  # type: ignore[arg-type]
    return SlidingWindowSpec(**common, sliding_window=window)  # type: ignore[arg-type]


def flag(r: ConfigReader, key: str) -> bool:
    value = r.raw(key)
    if not isinstance(value, bool):
        raise r.error(key, f"must be true or false, got {value!r}")
    return value


def typed_attention_layers(
    r: ConfigReader, types: list[str], *, head_dim: int, window: int | None
) -> IndexedLayers:
    full = attention_spec(r, head_dim=head_dim)
    sliding = attention_spec(r, head_dim=head_dim, window=window)
    return build_layers(
        types, {"full_attention": lambda i: [full], "sliding_attention": lambda i: [sliding]}
    )


def _layer_types_or(r: ConfigReader, rule: list[str]) -> list[str]:
    """``layer_types`` when the config lists them (they win), else the family rule."""
    types = r.layer_types(("layer_types",), len(rule), ATTENTION_TYPES)
    return rule if types is None else types


def _uniform(r: ConfigReader, window: int | None) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    rule = ["full_attention" if window is None else "sliding_attention"] * n
    return typed_attention_layers(
        r, _layer_types_or(r, rule), head_dim=head_dim_or_ratio(r), window=window
    )


def llama(r: ConfigReader) -> IndexedLayers:
    # LlamaConfig: head_dim defaults to hidden_size // num_attention_heads; no windows.
    n = r.get_int("num_hidden_layers")
    return typed_attention_layers(
        r, ["full_attention"] * n, head_dim=head_dim_or_ratio(r), window=None
    )


def mistral(r: ConfigReader) -> IndexedLayers:
    # MistralConfig.sliding_window (default 4096) applies to every layer
    # (modeling_mistral: create_sliding_window_causal_mask when it is set). transformers'
    # MistralModel ignores layer_types (it warns and points to Ministral); we honour them,
    # as the rule "per-layer types win" does for every family.
    return _uniform(r, r.get_optional_int("sliding_window"))


def _qwen_window(r: ConfigReader) -> int | None:
    # Qwen2Config / Qwen3Config / Qwen3MoeConfig: sliding_window = None unless use_sliding_window.
    return r.get_optional_int("sliding_window") if flag(r, "use_sliding_window") else None


def qwen2(r: ConfigReader) -> IndexedLayers:
    # Qwen2Config / Qwen3Config.__post_init__: layer i is sliding when a window is set and
    # i >= max_window_layers; modeling_qwen2 reads config.layer_types per layer.
    n = r.get_int("num_hidden_layers")
    window = _qwen_window(r)
    max_window_layers = r.get_int("max_window_layers", minimum=0)
    rule = [
        "sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
        for i in range(n)
    ]
    return typed_attention_layers(
        r, _layer_types_or(r, rule), head_dim=head_dim_or_ratio(r), window=window
    )


def qwen3_moe(r: ConfigReader) -> IndexedLayers:
    # modeling_qwen3_moe: every layer uses config.sliding_window (no max_window_layers).
    return _uniform(r, _qwen_window(r))


def gemma3_text(r: ConfigReader) -> IndexedLayers:
    # Gemma3TextConfig.__post_init__: sliding unless (i + 1) % sliding_window_pattern == 0.
    n = r.get_int("num_hidden_layers")
    pattern = r.get_int("sliding_window_pattern")
    rule = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return typed_attention_layers(
        r,
        _layer_types_or(r, rule),
        head_dim=r.get_int("head_dim"),
        window=r.get_optional_int("sliding_window"),
    )


def gpt_oss(r: ConfigReader) -> IndexedLayers:
    # GptOssConfig.__post_init__: even layers sliding, odd layers full. Sinks are weights.
    n = r.get_int("num_hidden_layers")
    rule = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return typed_attention_layers(
        r,
        _layer_types_or(r, rule),
        head_dim=head_dim_or_ratio(r),
        window=r.get_optional_int("sliding_window"),
    )


_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096}

ADAPTERS: dict[str, Adapter] = {
    "llama": Adapter("llama", llama),
    "mistral": Adapter("mistral", mistral, {"sliding_window": 4096}),
    "qwen2": Adapter("qwen2", qwen2, {**_QWEN_WINDOW, "max_window_layers": 28}),
    "qwen3": Adapter("qwen3", qwen2, {**_QWEN_WINDOW, "max_window_layers": 28, "head_dim": 128}),
    "qwen3_moe": Adapter("qwen3", qwen3_moe, _QWEN_WINDOW),
    "gemma3_text": Adapter(
        "gemma3",
        gemma3_text,
        {"head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 6},
    ),
    "gpt_oss": Adapter("gpt-oss", gpt_oss, {"head_dim": 64, "sliding_window": 128}),
}

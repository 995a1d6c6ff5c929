"""Mamba families: Jamba (Mamba1), Nemotron-H, Falcon-H1, Granite-4.0-H, pure Mamba2.

Mamba2 state (modeling_mamba2 / modeling_nemotron_h / ...): conv over
``intermediate + 2 * n_groups * d_state`` channels, ssm ``heads x head_dim x d_state``.
Mamba1 (modeling_jamba): conv over ``intermediate`` channels, ssm
``intermediate x d_state``, with ``intermediate = mamba_expand * hidden_size``.

Layer rules, from each transformers config class:

* Jamba: attention when ``i % attn_layer_period == attn_layer_offset``, else Mamba1.
* Nemotron-H: ``layers_block_type`` / ``layer_types`` if listed, else one character of
  ``hybrid_override_pattern`` per layer: ``M`` Mamba2, ``*`` attention, ``-`` MLP,
  ``E`` MoE. MLP and MoE layers hold no cache and are skipped::

      pattern  M - M * E      ->  layers (index, spec): (0, mamba2) (2, mamba2) (3, attn)

* Falcon-H1: every layer runs attention and Mamba2 side by side, so each decoder layer
  gives two specs, attention first.
* Granite-4.0-H: ``layer_types`` of mamba / attention (default: all Mamba2); attention
  uses RoPE only when ``position_embedding_type == "rope"`` (NoPE otherwise).
* Mamba2: every layer Mamba2.
"""

from __future__ import annotations

from hybridkv.models._fields import (
    Adapter,
    ConfigReader,
    IndexedLayers,
    build_layers,
    head_dim_or_ratio,
)
from hybridkv.models.dense import attention_spec
from hybridkv.spec.layers import Mamba1Spec, Mamba2Spec

HYBRID_TYPES = ("full_attention", "linear_attention")
NEMOTRON_TYPES = ("full_attention", "linear_attention", "mlp", "moe")
NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _mamba2(
    r: ConfigReader,
    *,
    heads: int,
    head_dim: int,
    d_state: int,
    groups: int,
    kernel: int,
    intermediate: int | None,
) -> Mamba2Spec:
    return Mamba2Spec(
        num_heads=heads,
        head_dim=head_dim,
        d_state=d_state,
        n_groups=groups,
        conv_kernel=kernel,
        intermediate_size=intermediate,
        conv_dtype=r.dtype,
        ssm_dtype=r.ssm_dtype,
    )


def _d_head(r: ConfigReader, key: str, intermediate: int, heads: int) -> int:
    """``mamba_d_head``; "auto" means intermediate // heads (Falcon-H1, Granite configs)."""
    value = r.raw(key)
    return intermediate // heads if value == "auto" else r.get_int(key)


def jamba(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    period, offset = r.get_int("attn_layer_period"), r.raw("attn_layer_offset")
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < period:
        raise r.error("attn_layer_offset", f"must be an int in [0, {period}), got {offset!r}")
    types = ["full_attention" if i % period == offset else "linear_attention" for i in range(n)]
    attn = attention_spec(r, head_dim=head_dim_or_ratio(r))
    mamba = Mamba1Spec(
        intermediate_size=r.get_int("mamba_expand") * r.get_int("hidden_size"),
        d_state=r.get_int("mamba_d_state"),
        conv_kernel=r.get_int("mamba_d_conv"),
        conv_dtype=r.dtype,
        ssm_dtype=r.ssm_dtype,
    )
    return build_layers(
        types, {"full_attention": lambda i: [attn], "linear_attention": lambda i: [mamba]}
    )


def _nemotron_types(r: ConfigReader) -> list[str]:
    # NemotronHConfig: an explicit layers_block_type (alias layer_types) wins over the
    # pattern; num_hidden_layers is the list's length.
    for key in ("layers_block_type", "layer_types"):
        listed = r.get_list(key) if key in r.config else None
        if listed is not None:
            types = r.layer_types((key,), len(listed), NEMOTRON_TYPES)
            assert types is not None
            return types
    pattern = r.get_str("hybrid_override_pattern")
    if pattern is None:
        raise r.error("hybrid_override_pattern", "is missing (and so is layers_block_type)")
    bad = sorted(set(pattern) - set(NEMOTRON_PATTERN))
    if bad:
        raise r.error(
            "hybrid_override_pattern",
            f"has unknown characters {bad}; allowed: {''.join(NEMOTRON_PATTERN)}",
        )
    return [NEMOTRON_PATTERN[c] for c in pattern]


def nemotron_h(r: ConfigReader) -> IndexedLayers:
    types = _nemotron_types(r)
    # NemotronHConfig.__post_init__: the legacy mamba_* names win when present.
    heads, head_dim = r.get_int("mamba_num_heads"), r.get_int("mamba_head_dim")
    mamba = _mamba2(
        r,
        heads=heads,
        head_dim=head_dim,
        d_state=r.get_int("ssm_state_size"),
        groups=r.get_first_int(("mamba_n_groups", "n_groups")),
        kernel=r.get_first_int(("mamba_d_conv", "conv_kernel")),
        intermediate=None,  # modeling_nemotron_h: intermediate = mamba_num_heads * head_dim
    )
    attn = attention_spec(r, head_dim=r.get_int("head_dim"))
    return build_layers(
        types,
        {
            "full_attention": lambda i: [attn],
            "linear_attention": lambda i: [mamba],
            "mlp": lambda i: [],
            "moe": lambda i: [],
        },
    )


def falcon_h1(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    d_ssm = r.get_optional_int("mamba_d_ssm")
    intermediate = r.get_int("mamba_expand") * r.get_int("hidden_size") if d_ssm is None else d_ssm
    heads = r.get_int("mamba_n_heads")
    mamba = _mamba2(
        r,
        heads=heads,
        head_dim=_d_head(r, "mamba_d_head", intermediate, heads),
        d_state=r.get_int("mamba_d_state"),
        groups=r.get_int("mamba_n_groups"),
        kernel=r.get_int("mamba_d_conv"),
        intermediate=intermediate,
    )
    attn = attention_spec(r, head_dim=head_dim_or_ratio(r))
    return build_layers(["hybrid"] * n, {"hybrid": lambda i: [attn, mamba]})


def granitemoehybrid(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    types = r.layer_types(("layer_types", "layers_block_type"), n, HYBRID_TYPES)
    types = ["linear_attention"] * n if types is None else types
    intermediate = r.get_int("mamba_expand") * r.get_int("hidden_size")
    heads = r.get_int("mamba_n_heads")
    mamba = _mamba2(
        r,
        heads=heads,
        head_dim=_d_head(r, "mamba_d_head", intermediate, heads),
        d_state=r.get_int("mamba_d_state"),
        groups=r.get_int("mamba_n_groups"),
        kernel=r.get_int("mamba_d_conv"),
        intermediate=intermediate,
    )
    # modeling_granitemoehybrid: rotary embedding only if position_embedding_type == "rope".
    use_rope = r.get_str("position_embedding_type") == "rope"
    attn = attention_spec(r, head_dim=head_dim_or_ratio(r), use_rope=use_rope)
    return build_layers(
        types, {"full_attention": lambda i: [attn], "linear_attention": lambda i: [mamba]}
    )


def mamba2(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    mamba = _mamba2(
        r,
        heads=r.get_int("num_heads"),
        head_dim=r.get_int("head_dim"),
        d_state=r.get_int("state_size"),
        groups=r.get_int("n_groups"),
        kernel=r.get_int("conv_kernel"),
        intermediate=r.get_int("expand") * r.get_int("hidden_size"),
    )
    return build_layers(["linear_attention"] * n, {"linear_attention": lambda i: [mamba]})


_MAMBA_FALCON_GRANITE = {
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_head": "auto",
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_n_heads": 128,
}

ADAPTERS: dict[str, Adapter] = {
    "jamba": Adapter(
        "jamba",
        jamba,
        {
            "num_key_value_heads": 8,
            "attn_layer_period": 8,
            "attn_layer_offset": 4,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
    ),
    "nemotron_h": Adapter(
        "nemotron-h",
        nemotron_h,
        {
            "num_key_value_heads": 8,
            "head_dim": 128,
            "ssm_state_size": 128,
            "mamba_num_heads": 128,
            "mamba_head_dim": 64,
            "n_groups": 8,
            "conv_kernel": 4,
            "mamba_ssm_cache_dtype": "float32",
        },
    ),
    "falcon_h1": Adapter(
        "falcon-h1",
        falcon_h1,
        {
            **_MAMBA_FALCON_GRANITE,
            "num_key_value_heads": 8,
            "mamba_d_ssm": 1024,
        },
    ),
    "granitemoehybrid": Adapter("granite-4.0-h", granitemoehybrid, _MAMBA_FALCON_GRANITE),
    "mamba2": Adapter(
        "mamba2",
        mamba2,
        {
            "num_heads": 128,
            "head_dim": 64,
            "state_size": 128,
            "expand": 2,
            "conv_kernel": 4,
            "n_groups": 8,
        },
    ),
}

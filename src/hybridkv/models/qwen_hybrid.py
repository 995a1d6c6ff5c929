"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet layers plus gated full attention.

Layer rule (``Qwen3NextConfig`` / ``Qwen3_5TextConfig.__post_init__``): ``layer_types``
when listed, else layer ``i`` is full attention when ``(i + 1) % full_attention_interval
== 0`` (default 4) and linear attention (Gated DeltaNet) otherwise::

    interval 4:  i = 0 1 2 3 4 5 6 7 ...
                     L L L F L L L F ...

Full-attention layers carry an output gate (weights only) and use partial RoPE; their
head_dim defaults to 256. The DeltaNet state is a conv over q, k, v of
``2 * Hk * dk + Hv * dv`` channels plus a recurrent ``Hv x dv x dk`` matrix
(modeling_qwen3_next.Qwen3NextGatedDeltaNet: conv_dim = key_dim * 2 + value_dim). Qwen3.5
checkpoints ask for a float32 recurrent state with ``mamba_ssm_dtype``.
"""

from __future__ import annotations

from hybridkv.models._fields import Adapter, ConfigReader, IndexedLayers, build_layers
from hybridkv.models.dense import attention_spec
from hybridkv.spec.layers import GatedDeltaNetSpec

GDN_TYPES = ("full_attention", "linear_attention")


def gated_delta_net(r: ConfigReader) -> IndexedLayers:
    n = r.get_int("num_hidden_layers")
    types = r.layer_types(("layer_types",), n, GDN_TYPES)
    if types is None:
        interval = r.get_int("full_attention_interval")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    attn = attention_spec(r, head_dim=r.get_int("head_dim"), gated=True)
    gdn = GatedDeltaNetSpec(
        num_k_heads=r.get_int("linear_num_key_heads"),
        num_v_heads=r.get_int("linear_num_value_heads"),
        head_k_dim=r.get_int("linear_key_head_dim"),
        head_v_dim=r.get_int("linear_value_head_dim"),
        conv_kernel=r.get_int("linear_conv_kernel_dim"),
        conv_dtype=r.dtype,
        ssm_dtype=r.ssm_dtype,
    )
    return build_layers(
        types, {"full_attention": lambda i: [attn], "linear_attention": lambda i: [gdn]}
    )


# Defaults shared by Qwen3NextConfig, Qwen3_5TextConfig and Qwen3_5MoeTextConfig.
_DEFAULTS = {
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}

ADAPTERS: dict[str, Adapter] = {
    "qwen3_next": Adapter("qwen3-next", gated_delta_net, _DEFAULTS),
    # Qwen3_5TextConfig defaults num_key_value_heads to 4 (Qwen3.5-9B style).
    "qwen3_5_text": Adapter("qwen3.5", gated_delta_net, {**_DEFAULTS, "num_key_value_heads": 4}),
    "qwen3_5_moe_text": Adapter("qwen3.5", gated_delta_net, _DEFAULTS),
}

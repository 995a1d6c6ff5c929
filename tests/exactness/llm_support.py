"""Tiny random-weight checkpoints (written by transformers, float32) and shared-prefix
prompts for the `LLM` exactness tests, plus their transformers reference tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import transformers
from exactness_harness import hf_greedy, save_tiny

VOCAB = 128
NUM_NEW = 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def _qwen3():
    return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**COMMON, num_hidden_layers=3)


def _qwen3_5():
    return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(
        **COMMON,
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"] * 2,
    )


def _gemma3():
    return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=4,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        final_logit_softcapping=30.0,
    )


def _nemotron_h():
    return transformers.NemotronHForCausalLM, transformers.NemotronHConfig(
        **COMMON,
        num_hidden_layers=5,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
    )


BUILDERS = {"qwen3": _qwen3, "qwen3_5": _qwen3_5, "gemma3": _gemma3, "nemotron_h": _nemotron_h}
HYBRIDS = ("qwen3_5", "nemotron_h", "granite", "falcon_h1", "lfm2", "jamba")


def _perturb(model, names: tuple[str, ...], scale: float = 0.5, seed: int = 5) -> None:
    """Add noise to parameters whose name contains one of ``names`` (init leaves norms at
    1 and sinks at 0, which would hide a wrong formula)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(n in name for n in names):
                param.add_(torch.randn(param.shape, generator=gen) * scale)


def _granite():
    """Granite-4.0-H: Mamba2 + NoPE attention, MoE + shared expert, all multipliers."""
    return transformers.GraniteMoeHybridForCausalLM, transformers.GraniteMoeHybridConfig(
        **{**COMMON, "intermediate_size": 32},
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=48,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0625,
        logits_scaling=6.0,
        initializer_range=0.1,
    )


def _falcon_h1():
    """Falcon-H1: attention and Mamba2 in parallel, every muP multiplier off 1."""
    return transformers.FalconH1ForCausalLM, transformers.FalconH1Config(
        **COMMON,
        num_hidden_layers=3,
        mamba_d_ssm=96,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        key_multiplier=0.7,
        attention_in_multiplier=1.3,
        attention_out_multiplier=0.8,
        ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.9,
        ssm_multipliers=[0.8, 1.1, 1.2, 0.9, 1.05],
        mlp_multipliers=[1.1, 0.9],
        initializer_range=0.1,
    )


def _gpt_oss():
    """gpt-oss: sliding (window 8) / full attention with sinks, YaRN rope, 4 experts."""
    return transformers.GptOssForCausalLM, transformers.GptOssConfig(
        **{**COMMON, "intermediate_size": 32},
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
    )


def _lfm2():
    """LFM2: gated short convs (L_cache 3) + q/k-normed GQA attention, untied head."""
    return transformers.Lfm2ForCausalLM, transformers.Lfm2Config(
        **COMMON,
        num_hidden_layers=5,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        conv_L_cache=3,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.5,
        block_multiple_of=32,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )


def _jamba():
    """Jamba: Mamba1 (dt/B/C norms) + NoPE attention, MoE on even layers, MLP on odd."""
    return transformers.JambaForCausalLM, transformers.JambaConfig(
        **{**COMMON, "intermediate_size": 48},
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        initializer_range=0.1,
    )


# Built on demand by `build_case` (not part of the shared LLM sweeps in test_llm_exact.py);
# the third entry perturbs parameters before saving.
MORE_BUILDERS = {
    "granite": (_granite, ()),
    "falcon_h1": (_falcon_h1, ()),
    "gpt_oss": (_gpt_oss, ("sinks",)),
    "lfm2": (_lfm2, ("norm",)),
    "jamba": (_jamba, ("norm",)),
}


def shared_prefix_prompts(vocab: int = VOCAB, seed: int = 3) -> list[list[int]]:
    """8 prompts: five share a 40-token system prefix (two of them 52 tokens), two share
    another 20, one is a single token; lengths from 1 to 61."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system, longer, other = draw(40), draw(12), draw(20)
    return [
        system + draw(5),
        system + longer + draw(9),
        system + draw(17),
        system + longer + draw(3),
        other + draw(7),
        system + draw(1),
        other + draw(14),
        draw(1),
    ]


@dataclass(frozen=True)
class Case:
    name: str
    folder: Path
    prompts: list[list[int]]
    expected: list[list[int]]

    @property
    def hybrid(self) -> bool:
        return self.name in HYBRIDS


def build_case(name: str, folder: Path) -> Case:
    if name in MORE_BUILDERS:
        builder, perturb = MORE_BUILDERS[name]
        model_cls, config = builder()
        hf = save_tiny(model_cls, config, folder)
        if perturb:
            _perturb(hf, perturb)
            hf.save_pretrained(folder)
    else:
        model_cls, config = BUILDERS[name]()
        hf = save_tiny(model_cls, config, folder)
    prompts = shared_prefix_prompts()
    return Case(name, folder, prompts, hf_greedy(hf, prompts, NUM_NEW))

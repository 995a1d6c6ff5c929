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
HYBRIDS = ("qwen3_5", "nemotron_h")


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
    model_cls, config = BUILDERS[name]()
    hf = save_tiny(model_cls, config, folder)
    prompts = shared_prefix_prompts()
    return Case(name, folder, prompts, hf_greedy(hf, prompts, NUM_NEW))

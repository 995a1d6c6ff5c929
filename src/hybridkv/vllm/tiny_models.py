"""Tiny random-weight checkpoints in geometries vLLM's CPU engine runs, for tests and
benchmarks (needs torch and transformers; no download).

``gemma3``: 6 layers, 5 sliding-window (window 128) + 1 full attention, head size 64,
vocabulary 4096: the sliding-window + full-attention family (no state layers).

``qwen3_next``: 8 layers, 6 Gated DeltaNet + 2 gated full attention, MoE with 4 experts,
head size 64 (vLLM's CPU attention takes 64, not 48; its Qwen3-Next needs a MoE layer),
vocabulary 4096. The geometry is the one vLLM's CPU engine was first run on here; its
state page (137,216 bytes with fp32 ssm state) is what makes vLLM pad 43% at 2048 tokens.
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


def write_tiny_gemma3(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny Gemma 3 text model (config.json + safetensors) to ``folder``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**GEMMA3)
    config.architectures = ["Gemma3ForCausalLM"]
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.save_pretrained(str(folder))
    return Path(folder)


def write_tiny_qwen3_next(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3-Next (config.json + safetensors) to ``folder``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**QWEN3_NEXT)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    model.save_pretrained(str(folder))
    return Path(folder)


if __name__ == "__main__":
    import sys

    writers = {"qwen3_next": write_tiny_qwen3_next, "gemma3": write_tiny_gemma3}
    kind = sys.argv[2] if len(sys.argv) > 2 else "qwen3_next"
    print(writers[kind](sys.argv[1]))

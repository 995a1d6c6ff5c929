"""Tiny Qwen3.5 / Qwen3-Next checkpoints with an MTP head, and a plain reference head.

transformers saves no ``mtp.*`` tensors, so after saving the main model we add them to
the safetensors file ourselves (the layout of the released checkpoints, see
`hybridkv.engine.models.mtp`) and state ``mtp_num_hidden_layers`` /
``num_nextn_predict_layers`` in config.json. The MTP decoder layer starts as a noisy
copy of the main model's full-attention layer 1, so it has every tensor transformers
would build for such a layer (gate, q/k norms, MoE experts and shared expert).

`ReferenceMTP` is the oracle: transformers' own decoder layer, norms and rotary
embedding, run over the whole sequence at every step (no KV cache, no pages, no
prefix cache), fed transformers' own final hidden states of the main model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from exactness_harness import save_tiny
from safetensors.torch import load_file, save_file

NUM_MTP = 1
ECHO_TIE = 0.3
MAIN_ATTENTION_LAYER = 1  # a full-attention layer of both configs below
LAYER_TYPES = ["linear_attention", "full_attention"] * 2
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    layer_types=LAYER_TYPES,
)


def _config(kind: str):
    if kind == "qwen3_5":
        return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**COMMON)
    return transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(
        **COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
    )


MTP_CONFIG_KEY = {"qwen3_5": "mtp_num_hidden_layers", "qwen3_next": "num_nextn_predict_layers"}


def build_mtp_checkpoint(
    kind: str, folder: Path, seed: int = 0, *, echo: bool = False
) -> transformers.PreTrainedModel:
    """Save a tiny ``kind`` model with an added MTP head to ``folder``; returns the
    transformers main model (float32, eval).

    ``echo``: a head that mostly proposes the token it is fed (fc passes the embedding
    through, the decoder layer's outputs are damped, the LM head is tied), so drafts
    are accepted wherever the main model repeats a token, rejected elsewhere."""
    model_cls, config = _config(kind)
    hf = save_tiny(model_cls, config, folder, seed=seed)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed + 11)
    hidden = config.hidden_size

    def noise(shape, scale):
        return torch.randn(shape, generator=gen) * scale

    src = f"model.layers.{MAIN_ATTENTION_LAYER}."
    for name in [n for n in tensors if n.startswith(src)]:
        base = tensors[name]
        tensors["mtp.layers.0." + name[len(src) :]] = base + noise(base.shape, 0.02)
    tensors["mtp.fc.weight"] = noise((hidden, 2 * hidden), 0.08)
    if echo:
        tensors["mtp.fc.weight"][:, :hidden] += torch.eye(hidden) * 4.0
        # Half tied: the main model repeats its input token often, not always.
        tensors["lm_head.weight"] = (
            tensors["lm_head.weight"] + ECHO_TIE * tensors["model.embed_tokens.weight"]
        )
        for name in tensors:
            if name.startswith("mtp.layers.0.") and ("o_proj" in name or "down_proj" in name):
                tensors[name] = tensors[name] * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = noise((hidden,), 0.2)
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg[MTP_CONFIG_KEY[kind]] = NUM_MTP
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if not echo:
        return hf
    # The LM head changed on disk: the reference main model must be the saved one.
    return model_cls.from_pretrained(folder, dtype=torch.float32).eval()


class ReferenceMTP:
    """The MTP head in plain transformers modules (module doc of mtp_support)."""

    def __init__(self, hf: transformers.PreTrainedModel, folder: Path) -> None:
        self.hf = hf
        config = hf.config
        tensors = load_file(str(folder / "model.safetensors"))
        norm_cls = type(hf.model.norm)
        layer_cls = type(hf.model.layers[MAIN_ATTENTION_LAYER])

        def norm(name):
            module = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
            module.load_state_dict({"weight": tensors[f"mtp.{name}.weight"]})
            return module.float().eval()

        self.norm_e = norm("pre_fc_norm_embedding")
        self.norm_h = norm("pre_fc_norm_hidden")
        self.norm = norm("norm")
        self.fc = tensors["mtp.fc.weight"]
        self.layer = layer_cls(config, MAIN_ATTENTION_LAYER).float().eval()
        prefix = "mtp.layers.0."
        state = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
        self.layer.load_state_dict(_fuse_experts(state), strict=True)

    @torch.no_grad()
    def _head(self, inputs: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Head outputs at every position: row p fed (embedding of inputs[p], features[p])."""
        embed = self.hf.model.embed_tokens(inputs[None])
        x = torch.cat((self.norm_e(embed), self.norm_h(features[None])), dim=-1) @ self.fc.T
        num = x.shape[1]
        positions = torch.arange(num)[None]
        cos_sin = self.hf.model.rotary_emb(x, positions)
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions
        )
        if isinstance(out, tuple):
            out = out[0]
        return self.norm(out)[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], num: int) -> list[int]:
        """The head's ``num`` chained proposals after the verified ``tokens``."""
        ids = torch.tensor([tokens])
        hidden = self.hf.model(ids).last_hidden_state[0]  # final-normed, [n, H]
        inputs = torch.tensor(tokens[1:])  # row p: token p + 1
        features = hidden[:-1]
        out: list[int] = []
        for _ in range(num):
            heads = self._head(inputs, features)
            last = heads[-1]
            token = int((last @ self.hf.lm_head.weight.T).argmax())
            out.append(token)
            inputs = torch.cat((inputs, torch.tensor([token])))
            features = torch.cat((features, last[None]))
        return out


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (as saved on disk) to
    the fused ``mlp.experts.gate_up_proj`` / ``down_proj`` parameters of transformers'
    module, the way transformers converts them when it loads such a checkpoint."""
    experts = sorted({int(n.split(".")[2]) for n in state if n.startswith("mlp.experts.")})
    if not experts:
        return state
    out = {n: t for n, t in state.items() if not n.startswith("mlp.experts.")}
    key = "mlp.experts.{}.{}_proj.weight"
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat((state[key.format(e, "gate")], state[key.format(e, "up")])) for e in experts]
    )
    out["mlp.experts.down_proj"] = torch.stack([state[key.format(e, "down")] for e in experts])
    return out

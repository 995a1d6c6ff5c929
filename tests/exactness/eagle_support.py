"""Tiny EAGLE head folders (`hybridkv.engine.models.eagle` format) and a plain reference.

The head's decoder layer is a Qwen3 decoder layer, so the reference runs transformers'
own ``Qwen3DecoderLayer``, ``Qwen3RMSNorm`` and rotary embedding over the whole sequence
at every step (no cache, no pages), fed transformers' hidden states of the main model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.qwen3 import modeling_qwen3

AUX_LAYERS = [0, 1, 2]  # outputs of these main decoder layers (not the last: see below)


def head_config(hidden: int) -> dict:
    return {
        "format": "hybridkv-eagle",
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 96,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "aux_layers": AUX_LAYERS,
    }


def _qwen3_config(cfg: dict) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=8,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
    )


def build_eagle_head(folder: Path, hidden: int, seed: int = 0, *, echo: bool = False) -> None:
    """Write a random EAGLE head for a main model of width ``hidden``. ``echo``: the
    head mostly proposes the token it is fed (see mtp_support.build_mtp_checkpoint)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head_config(hidden)
    torch.manual_seed(seed)
    layer = modeling_qwen3.Qwen3DecoderLayer(_qwen3_config(cfg), 0).float()
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {f"layers.0.{n}": t.detach().clone() for n, t in layer.state_dict().items()}
    for name in tensors:
        if name.endswith("norm.weight"):  # init leaves norms at 1: perturb them
            tensors[name] = tensors[name] + torch.randn(tensors[name].shape, generator=gen) * 0.2
    tensors["fc_aux.weight"] = torch.randn(hidden, len(AUX_LAYERS) * hidden, generator=gen) * 0.1
    tensors["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"{norm}.weight"] = 1.0 + torch.randn(hidden, generator=gen) * 0.2
    if echo:
        tensors["fc.weight"][:, :hidden] += torch.eye(hidden) * 4.0
        for name in list(tensors):
            if "o_proj" in name or "down_proj" in name:
                tensors[name] = tensors[name] * 0.1
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "eagle_config.json").write_text(json.dumps(cfg, indent=2))


class ReferenceEagle:
    def __init__(self, hf: transformers.PreTrainedModel, folder: Path) -> None:
        from safetensors.torch import load_file

        self.hf = hf
        cfg = json.loads((folder / "eagle_config.json").read_text())
        tensors = load_file(str(folder / "model.safetensors"))
        qcfg = _qwen3_config(cfg)
        self.layer = modeling_qwen3.Qwen3DecoderLayer(qcfg, 0).float().eval()
        prefix = "layers.0."
        self.layer.load_state_dict(
            {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
        )
        self.rotary = modeling_qwen3.Qwen3RotaryEmbedding(qcfg)

        def norm(name):
            module = modeling_qwen3.Qwen3RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])
            module.load_state_dict({"weight": tensors[f"{name}.weight"]})
            return module.eval()

        self.norm_e, self.norm_h, self.norm = (
            norm("pre_fc_norm_embedding"),
            norm("pre_fc_norm_hidden"),
            norm("norm"),
        )
        self.fc_aux, self.fc = tensors["fc_aux.weight"], tensors["fc.weight"]

    @torch.no_grad()
    def _outs(self, inputs: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        embed = self.hf.model.embed_tokens(inputs[None])
        x = torch.cat((self.norm_e(embed), self.norm_h(feats[None])), dim=-1) @ self.fc.T
        num = x.shape[1]
        positions = torch.arange(num)[None]
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )
        return (out[0] if isinstance(out, tuple) else out)[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], num: int) -> list[int]:
        ids = torch.tensor([tokens])
        states = self.hf.model(ids, output_hidden_states=True).hidden_states
        # hidden_states[i + 1] is the output of decoder layer i (the last entry may be
        # final-normed, which is why AUX_LAYERS avoids the last layer).
        aux = torch.cat([states[i + 1][0] for i in AUX_LAYERS], dim=-1)
        feats = (aux @ self.fc_aux.T)[:-1]
        inputs = torch.tensor(tokens[1:])
        out: list[int] = []
        for _ in range(num):
            last = self._outs(inputs, feats)[-1]
            token = int((self.norm(last) @ self.hf.lm_head.weight.T).argmax())
            out.append(token)
            inputs = torch.cat((inputs, torch.tensor([token])))
            feats = torch.cat((feats, last[None]))
        return out

#!/usr/bin/env python
"""Train an MTP head for the demo main model (``hybridkv demo --spec-method mtp``).

The demo main (``demo_models/main``, a Qwen3.5 hybrid) stays frozen. The head has the
layout of Qwen3.5's own MTP layers (`hybridkv.engine.models.mtp`): two zero-centred
norms, ``fc`` over cat(embedding of token p + 1, main hidden state at p), one
full-attention decoder layer (initialised from the main model's layer 2) and a final
norm, with the main model's tied embedding / LM head. Objective: cross-entropy of the
token at p + 2, on the same corpus as ``train_demo_models.py`` (the Python stdlib
sources, same held-out modules), windows drawn by a seeded generator; the main
model's hidden states are computed once per window.

Output (``--out``, default ``src/hybridkv/engine/models/demo_models/mtp``)::

    config.json         the main's config + "mtp_num_hidden_layers": 1
    model.safetensors   mtp.* tensors only (bfloat16)
    metadata.json       settings, corpus digest, losses, held-out top-1 accuracy of the
                        head, and the engine's measured acceptance on the demo prompts

Example (CPU, one thread: about 5 minutes on a shared 2-core machine)::

    python scripts/train_demo_mtp.py --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import train_demo_models as corpus  # noqa: E402  (same corpus, same held-out split)

DEMO = REPO / "src" / "hybridkv" / "engine" / "models" / "demo_models"
INIT_LAYER = 2  # a full-attention layer of the demo main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--main", type=Path, default=DEMO / "main")
    p.add_argument("--out", type=Path, default=DEMO / "mtp")
    p.add_argument("--windows", type=int, default=2048, help="training windows (hidden cached)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--spec-k", type=int, default=3, help="K for the engine acceptance run")
    p.add_argument("--spec-new-tokens", type=int, default=64)
    return p.parse_args(argv)


class Head:
    """The trainable head (transformers modules), mirroring the engine's MTP head."""

    def __init__(self, torch: Any, main: Any) -> None:
        nn = torch.nn
        hidden = main.config.hidden_size
        norm_cls = type(main.model.norm)
        self.main = main
        self.norm_e = norm_cls(hidden, eps=main.config.rms_norm_eps)
        self.norm_h = norm_cls(hidden, eps=main.config.rms_norm_eps)
        self.norm = norm_cls(hidden, eps=main.config.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():  # start as "the hidden state, plus a little of the token"
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:] = torch.eye(hidden)
            self.fc.weight[:, :hidden] = torch.randn(hidden, hidden) * 0.02
        self.layer = copy.deepcopy(main.model.layers[INIT_LAYER])
        for p in self.parameters():
            p.requires_grad_(True)

    def modules(self) -> dict[str, Any]:
        return {
            "pre_fc_norm_embedding": self.norm_e,
            "pre_fc_norm_hidden": self.norm_h,
            "norm": self.norm,
            "fc": self.fc,
            "layers.0": self.layer,
        }

    def parameters(self) -> list[Any]:
        return [p for m in self.modules().values() for p in m.parameters()]

    def logits(self, torch: Any, ids: Any, hidden: Any) -> Any:
        """Logits for the token at p + 2 from (ids[p + 1], hidden[p]), p = 0 .. L - 2."""
        embed = self.main.model.embed_tokens(ids[:, 1:])
        x = self.fc(torch.cat((self.norm_e(embed), self.norm_h(hidden[:, :-1])), dim=-1))
        num = x.shape[1]
        positions = torch.arange(num)[None].expand(x.shape[0], -1)
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x,
            position_embeddings=self.main.model.rotary_emb(x, positions),
            attention_mask=mask,
            position_ids=positions,
        )
        out = out[0] if isinstance(out, tuple) else out
        return self.main.lm_head(self.norm(out)).float()

    def state_dict(self, torch: Any) -> dict[str, Any]:
        out = {}
        for prefix, module in self.modules().items():
            for name, tensor in module.state_dict().items():
                out[f"mtp.{prefix}.{name}"] = tensor.detach().to(torch.bfloat16).contiguous()
        return out


def hidden_states(torch: Any, main: Any, windows: Any, batch: int = 32) -> Any:
    with torch.no_grad():
        parts = [
            main.model(windows[i : i + batch]).last_hidden_state
            for i in range(0, len(windows), batch)
        ]
    return torch.cat(parts)


def loss_of(torch: Any, head: Head, ids: Any, hidden: Any) -> tuple[Any, Any]:
    import torch.nn.functional as F

    logits = head.logits(torch, ids, hidden)[:, :-1]  # the last position has no p + 2
    targets = ids[:, 2:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, (logits.argmax(-1) == targets).float().mean()


def engine_acceptance(main_dir: Path, mtp_dir: Path, k: int, new_tokens: int) -> dict[str, Any]:
    """``hybridkv demo``'s prompts through the engine with the saved head, K drafts."""
    from hybridkv.demo import demo_prompts
    from hybridkv.engine import LLM

    llm = LLM(main_dir, spec_method="mtp", draft=mtp_dir, num_spec_tokens=k, max_model_len=1024)
    results = llm.generate(demo_prompts(8), new_tokens)
    plain = LLM(main_dir, max_model_len=1024).generate(demo_prompts(8), new_tokens)
    s = llm.stats()
    return {
        "k": k,
        "prompts": 8,
        "new_tokens": new_tokens,
        "output_equals_non_speculative": [r.token_ids for r in results]
        == [r.token_ids for r in plain],
        "num_proposed_tokens": s.num_proposed_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "tokens_per_step": s.tokens_per_step,
    }


def _shown(value: Any) -> Any:
    """Paths relative to the repository when inside it (metadata stays machine-neutral)."""
    if not isinstance(value, Path):
        return value
    path = value.resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    stdlib = corpus.stdlib_dir()
    paths = corpus.train_paths(stdlib)
    texts, records = corpus.read_files(stdlib, paths)
    data = corpus.to_ids(torch, texts)
    held_paths = [corpus.module_path(stdlib, n) for n in corpus.HELDOUT_MODULES]
    held_texts, _held_records = corpus.read_files(stdlib, [p for p in held_paths if p])
    heldout = corpus.to_ids(torch, held_texts)

    main_model = AutoModelForCausalLM.from_pretrained(str(args.main), dtype=torch.float32).eval()
    for p in main_model.parameters():
        p.requires_grad_(False)
    if main_model.config.layer_types[INIT_LAYER] != "full_attention":
        raise SystemExit(f"layer {INIT_LAYER} of {args.main} is not a full-attention layer")

    gen = torch.Generator().manual_seed(args.seed)
    windows = corpus.batch_at(torch, data, gen, args.windows, args.seq_len, "cpu")
    t0 = time.perf_counter()
    hidden = hidden_states(torch, main_model, windows)
    eval_ids = corpus.heldout_windows(torch, heldout, args.seq_len, args.eval_windows)
    eval_hidden = hidden_states(torch, main_model, eval_ids)
    hidden_s = time.perf_counter() - t0

    head = Head(torch, main_model)
    params = head.parameters()
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = corpus.lr_at(step, args.steps, args.lr, args.warmup)
        pick = torch.randint(0, args.windows, (args.batch_size,), generator=gen)
        loss, _acc = loss_of(torch, head, windows[pick], hidden[pick])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {losses[-1]:.3f}", flush=True)
    train_s = time.perf_counter() - t0
    with torch.no_grad():
        eval_loss, eval_acc = loss_of(torch, head, eval_ids, eval_hidden)

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(
        head.state_dict(torch), str(args.out / "model.safetensors"), metadata={"format": "pt"}
    )
    config = json.loads((args.main / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (args.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    acceptance = engine_acceptance(args.main, args.out, args.spec_k, args.spec_new_tokens)
    last = losses[-50:]
    meta = {
        "description": "MTP head for the hybridkv demo main (frozen), Qwen3.5 MTP layout",
        "command": "python scripts/train_demo_mtp.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: _shown(v) for k, v in vars(args).items()},
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__},
        "corpus": {"files": len(records), "sha256": corpus.corpus_digest(records)},
        "training": {
            "final_loss": sum(last) / len(last),
            "loss_averaged_over_last_steps": len(last),
            "hidden_states_s": round(hidden_s, 1),
            "train_s": round(train_s, 1),
        },
        "heldout": {
            "windows": int(eval_ids.shape[0]),
            "ce_token_p_plus_2": float(eval_loss),
            "top1_token_p_plus_2": float(eval_acc),
            "bits_per_byte": float(eval_loss) / math.log(2.0),
        },
        "engine_acceptance": acceptance,
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    (args.out / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({"heldout": meta["heldout"], "engine_acceptance": acceptance}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

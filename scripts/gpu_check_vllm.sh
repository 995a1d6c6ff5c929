#!/usr/bin/env bash
# vLLM 0.33 (CUDA) with hybridkv's plugin on the seed geometry, dummy weights: a
# Qwen3-Coder-Next-shaped main model (48 layers: 36 Gated DeltaNet + 12 attention; MoE cut
# to 32 experts so dummy weights fit one GPU) + a dense Qwen3-4B draft, fp8 KV, 3 draft
# tokens, 32K context. Starts stock vLLM and vLLM + hybridkv, serves a few greedy requests
# on each and prints what each logged about its KV cache.
# Needs a CUDA machine with vLLM 0.33 installed (`pip install 'hybridkv[vllm]'` beside it).
# Leave VLLM_KV_CACHE_LAYOUT unset: the plugin then lets workers pick BLNHC when its plan
# holds more requests. With prefix caching on Hopper (FlashInfer's 64-token state grid)
# expect the builder to keep vLLM's grouping and log why (docs/vllm_plugin.md).
#   PYTHON=/path/to/python bash scripts/gpu_check_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'cuda', torch.cuda.is_available())"
work=$(mktemp -d)
timeout 1500 "$PY" - "$work" <<'PYEOF'
import sys

from hybridkv.vllm.engine_process import EngineProcess
from hybridkv.vllm.tiny_models import write_seed_configs

main_dir, draft_dir = write_seed_configs(sys.argv[1])
settings = {
    "model": str(main_dir), "load_format": "dummy", "max_model_len": 32768,
    "kv_cache_dtype": "fp8_e4m3", "gpu_memory_utilization": 0.85, "enforce_eager": False,
    "speculative_config": {"method": "draft_model", "model": str(draft_dir),
                           "num_speculative_tokens": 3},
}
prompts = [[(7 * i + j) % 151000 + 1 for j in range(512)] for i in range(4)]
for plugin in (False, True):
    with EngineProcess(sys.executable, settings, plugin=plugin) as proc:
        out = proc.call({"op": "generate", "prompts": prompts, "max_tokens": 32})
        log = proc.kv_log()
        print("plugin" if plugin else "stock", log, "tokens", [len(o) for o in out["outputs"]])
PYEOF
# hybridkv's cache manager behind vLLM's scheduler (docs/vllm_scheduler.md) on CUDA: the
# tiny Qwen3-Next hybrid (no draft: drafts on state-layer models are refused), multi-turn
# chat, stock vs --scheduler-cls hybridkv.vllm.Scheduler, hits per turn and the scheduler
# check after the run.
timeout 900 "$PY" - "$work" <<'PYEOF'
import sys
from pathlib import Path

from hybridkv.vllm.engine_process import EngineProcess
from hybridkv.vllm.tiny_models import write_tiny_qwen3_next

model = write_tiny_qwen3_next(Path(sys.argv[1]) / "tiny_qwen3_next")
base = {"model": str(model), "max_model_len": 2048, "in_process": True, "enforce_eager": True}
chat = {"op": "chat", "sessions": 8, "turns": 3, "first_tokens": 300, "user_tokens": 30,
        "max_tokens": 24, "seed": 3}
for extra in ({}, {"scheduler_cls": "hybridkv.vllm.Scheduler"}):
    with EngineProcess(sys.executable, {**base, **extra}, plugin=True) as proc:
        turns = proc.call(chat)["turns"]
        print(extra or "stock", [(t["hit_tokens"], t["bound_tokens"]) for t in turns],
              proc.call({"op": "sched"}))
PYEOF

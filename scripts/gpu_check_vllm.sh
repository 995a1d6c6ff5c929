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

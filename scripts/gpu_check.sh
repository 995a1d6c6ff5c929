#!/usr/bin/env bash
# One-shot CUDA check of the reference engine (run from anywhere; needs no network and
# no install: the package is put on PYTHONPATH from src/).
#   1. versions and the CUDA device
#   2. pytest tests/gpu -m gpu   (LLM on CUDA vs transformers on CUDA; speculative vs plain)
#   3. hybridkv demo --json --device cuda   (small batch)
#   4. bench/engine_vs_hf.py --device cuda   (throughput table against transformers on
#      CUDA, 3 alternating reps, token-exact check per case)
#   5. bench/engine_vs_vllm.py --device cuda   (against vLLM's own engine on the same
#      random-weight Qwen3-Next-style model, bf16, 3 alternating reps), only where a
#      python with vLLM is found: $VLLM_PYTHON, else $PYTHON if it imports vllm; skipped
#      (not failed) otherwise, or with SKIP_VLLM_BENCH=1. vLLM's start-up is untimed.
# Exit status: 0 when every step passes, else the first failing step's status. Each step
# is capped with `timeout`: steps 1-4 stay under 6 minutes, step 5 adds at most 7.
set -x
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python}"
start=$(date +%s)

"$PY" - <<'PYEOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("torch", "transformers", "safetensors", "numpy", "typer", "rich", "xxhash",
             "pytest", "hybridkv"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:13s}", getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as err:  # report, do not stop: the steps below say what breaks
        print(f"{name:13s} MISSING ({type(err).__name__}: {err})")
import torch
print("cuda available", torch.cuda.is_available(), "torch cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
PYEOF

status=0
# --confcutdir: only tests/gpu's own conftest (none) is loaded, so the suite-wide
# tests/conftest.py (hypothesis profiles) is not needed on this machine.
timeout 75 "$PY" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider --confcutdir=tests/gpu
pytest_status=$?
[ "$pytest_status" -ne 0 ] && status=$pytest_status

timeout 30 "$PY" -m hybridkv demo --json --device cuda --num-requests 4 \
    --max-new-tokens 32 > /tmp/hybridkv_demo_cuda.json
demo_status=$?
if [ "$demo_status" -eq 0 ]; then
    "$PY" -c 'import json; r = json.load(open("/tmp/hybridkv_demo_cuda.json")); print(json.dumps({k: r[k] for k in ("device", "spec", "prefix_cache", "stop", "num_steps", "wall_s")}, indent=1)); print([o["text"][:40] for o in r["outputs"]])'
else
    cat /tmp/hybridkv_demo_cuda.json
    [ "$status" -eq 0 ] && status=$demo_status
fi

# Both sides on the GPU, fp32, the CPU benchmark's model and prompts. Threads: 1 (the
# host only launches kernels); tokens are compared per case.
timeout 240 "$PY" bench/engine_vs_hf.py --device cuda --threads 1 --reps 3
bench_status=$?
[ "$bench_status" -ne 0 ] && [ "$status" -eq 0 ] && status=$bench_status

# Against vLLM (CUDA build, e.g. 0.33) when one is installed: both sides bf16 on the GPU.
vllm_status=skipped
VLLM_PY="${VLLM_PYTHON:-}"
if [ -z "$VLLM_PY" ] && "$PY" -c 'import vllm' >/dev/null 2>&1; then VLLM_PY="$PY"; fi
if [ "${SKIP_VLLM_BENCH:-0}" != 1 ] && [ -n "$VLLM_PY" ]; then
    timeout 420 "$PY" bench/engine_vs_vllm.py --device cuda --reps 3 --cases 1,32,shared32 \
        --vllm-python "$VLLM_PY"
    vllm_status=$?
    [ "$vllm_status" -ne 0 ] && [ "$status" -eq 0 ] && status=$vllm_status
else
    echo "engine_vs_vllm: skipped (no python with vLLM: set VLLM_PYTHON)"
fi

set +x
echo "gpu_check: pytest exit $pytest_status, demo exit $demo_status," \
    "bench exit $bench_status, vllm bench $vllm_status, $(( $(date +%s) - start )) s"
exit "$status"

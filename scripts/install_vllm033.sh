#!/usr/bin/env bash
# vLLM 0.33.0 (the CUDA wheel's Python code) in its own virtualenv on a CPU-only machine, with
# only the pure-Python packages its KV-cache planning, config and Qwen3-Next model classes
# import, and hybridkv installed beside it. Nothing of vLLM is built and no kernel runs: it is
# enough to run vLLM 0.33's own `get_kv_cache_configs`, its KV-cache manager and its worker's
# allocator on CPU (tests/vllm033). About 2 GB and 1-2 minutes. Adapted from the project's
# vLLM-CPU benchmark-peer install notes.
#   bash scripts/install_vllm033.sh [VENV_DIR]     (default .venv-vllm033)
#   VLLM_TARGET_DEVICE=cpu VENV_DIR/bin/python -m pytest -m vllm tests/vllm033
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$here/.venv-vllm033}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install torch==2.13.0          # the CPU build; vLLM's planning code is plain Python
"${pip[@]}" install --no-deps vllm==0.33.0
"${pip[@]}" install --no-deps -r "$here/scripts/vllm033_requirements.txt"
# hybridkv itself; --no-deps keeps vLLM's pins intact (its own dependencies are listed above)
"${pip[@]}" install --no-deps -e "$here"
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "
from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder
import hybridkv.vllm.builder, vllm
print('vllm', vllm.__version__, 'with hybridkv.vllm.builder')"

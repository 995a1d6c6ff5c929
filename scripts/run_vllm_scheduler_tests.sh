#!/usr/bin/env bash
# vLLM 0.33.0's own scheduler tests (tests/v1/core/test_scheduler.py, CPU), run twice: on
# vLLM's scheduler (the baseline: what fails there is the environment's or vLLM's) and with
# hybridkv.vllm.Scheduler swapped in by the pytest plugin tests/vllm033/swap_scheduler.py.
# vLLM's test files are downloaded from its source release (sha256 checked) into a temp
# folder and run unchanged; nothing of them enters this repository. The tests read model
# configs only: the plugin writes config.json files for their three model names into an
# offline hub cache. Prints a summary (docs/vllm_scheduler_tests.md classifies it).
# About 15-20 minutes per run on 2 busy cores.
#   bash scripts/run_vllm_scheduler_tests.sh [VENV_DIR] [-- extra pytest args]
#   (hybridkv is imported from this checkout's src/, whatever the venv has installed)
#   env: VLLM_SDIST=path/to/vllm-0.33.0.tar.gz (skip the download), WORK_DIR=folder (keep
#        the logs there), SKIP_STOCK=1 (reuse WORK_DIR/stock.jsonl),
#        TESTS_FILE=file (the vLLM test ids to run, one per line, instead of
#        test_scheduler.py; scripts/vllm_async_scheduler_tests.txt: the async-scheduling
#        tests, ~2 minutes per run)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$here/.venv-vllm033
if [ $# -gt 0 ] && [ "$1" != "--" ]; then venv=$1; shift; fi
[ "${1:-}" = "--" ] && shift
python=$venv/bin/python
[ -x "$python" ] || { echo "no $python: run scripts/install_vllm033.sh first" >&2; exit 2; }

version=0.33.0
sha256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
work=${WORK_DIR:-$(mktemp -d -t hybridkv-vllm-tests-XXXXXX)}
mkdir -p "$work"
sdist=${VLLM_SDIST:-$work/vllm-$version.tar.gz}
if [ ! -f "$sdist" ]; then
    # The sdist's URL from PyPI's simple index (PEP 691 JSON), as pip finds it; `pip
    # download --no-binary` would also try to build vLLM's metadata (CUDA toolchain).
    "$python" - "$version" "$sdist" <<'EOF'
import json, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
request = urllib.request.Request(
    "https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
)
with urllib.request.urlopen(request, timeout=120) as response:
    files = json.load(response)["files"]
(url,) = [f["url"] for f in files if f["filename"] == f"vllm-{version}.tar.gz"]
urllib.request.urlretrieve(url, dest)
EOF
fi
echo "$sha256  $sdist" | sha256sum -c --quiet -
src=$work/vllm-$version
[ -d "$src/tests" ] || tar -xzf "$sdist" -C "$work" "vllm-$version/tests" "vllm-$version/pyproject.toml"
"$python" "$here/tests/vllm033/swap_scheduler.py" hub "$work/hub"
tests=(tests/v1/core/test_scheduler.py)
if [ -n "${TESTS_FILE:-}" ]; then
    mapfile -t tests < <(grep -v '^\s*\(#\|$\)' "$TESTS_FILE")
fi

run() {  # run NAME SWAP [pytest args]
    local name=$1 swap=$2
    shift 2
    rm -f "$work/$name.jsonl"
    (cd "$src" && HF_HUB_CACHE="$work/hub" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        VLLM_TARGET_DEVICE=cpu PYTHONPATH="$here/src:$here/tests/vllm033" HYBRIDKV_SWAP=$swap \
        HYBRIDKV_SWAP_LOG="$work/$name.jsonl" "$python" -m pytest "${tests[@]}" \
        -q -p no:cacheprovider -p swap_scheduler --timeout 300 "$@" >"$work/$name.out" 2>&1) || true
    tail -n 1 "$work/$name.out"
}
start=$(date +%s)
if [ "${SKIP_STOCK:-0}" != 1 ]; then
    echo "vLLM's scheduler:"; run stock 0 "$@"
fi
echo "hybridkv.vllm.Scheduler:"; run swapped 1 "$@"
echo "($(($(date +%s) - start)) s; logs in $work)"
echo
"$python" "$here/tests/vllm033/swap_scheduler.py" summary "$work/stock.jsonl" "$work/swapped.jsonl"

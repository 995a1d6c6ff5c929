"""The seed configurations through the server: fp8 KV with a dense draft (K = 3) and the
demo's MTP head with fp8 KV. Concurrent greedy streams must give exactly the offline
`LLM.generate` text of the same configuration (same fp8 numerics), and a repeated
prompt must hit the prefix cache."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.engine

PROMPTS = [
    "import os\nimport sys\n\ndef main(",
    "class Config:\n    def __init__(self",
    "def read_lines(path):\n    with open(path) as f:\n",
]
CONFIGS = {
    "fp8-draft": {"draft": "demo-draft", "num_spec": 3, "kv_dtype": "fp8_e4m3"},
    "fp8-mtp": {"spec_method": "mtp", "draft": "demo-mtp", "num_spec": 3, "kv_dtype": "fp8_e4m3"},
    # A token tree of 5 nodes from the demo MTP head (docs/tree_drafts.md), verified in one pass.
    "fp8-mtp-tree": {
        "spec_method": "mtp",
        "draft": "demo-mtp",
        "num_spec": 5,
        "spec_tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]],
        "kv_dtype": "fp8_e4m3",
    },
}


def stream_text(url: str, prompt: str) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_seed_config_served_equals_offline(name: str) -> None:
    from hybridkv.cli.engine import load_llm
    from hybridkv.serve.server import BackgroundServer

    torch.set_num_threads(1)
    args = CONFIGS[name]
    offline = load_llm("demo", **args)
    assert str(offline.plan.options.kv_dtype) in ("fp8_e4m3", "DType.FP8_E4M3")
    expected = [r.text for r in offline.generate(PROMPTS, 24, ignore_eos=False)]
    with BackgroundServer(load_llm("demo", **args), "m") as srv:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: stream_text(srv.url, p), PROMPTS))
        # Text is decoded without special tokens; the demo byte tokenizer has none in code.
        assert got == expected
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            before = c.get("/metrics").text
            long_prompt = PROMPTS[0] * 60  # past the coarsest state checkpoint (1440 tokens)
            for _ in range(2):
                body = {"model": "m", "prompt": long_prompt, "max_tokens": 4, "temperature": 0}
                assert c.post("/v1/completions", json=body).status_code == 200
            after = c.get("/metrics").text
    assert _metric(after, "hybridkv:prefix_cache_hits_total") > _metric(
        before, "hybridkv:prefix_cache_hits_total"
    )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")

"""A real server for the HTTP tests: the demo pair (main + draft model, K = 4) behind
uvicorn on 127.0.0.1 and a free port, on a background thread; stopped after the module.
Also the same engine offline (`LLM.generate`) for the expected texts.

torch, fastapi and httpx are imported by the fixtures, so the torch-free tests of this
folder run without the extras."""

from __future__ import annotations

import pytest

DEMO_ARGS = {"draft": "demo-draft", "num_spec": 4}


@pytest.fixture(scope="module")
def server():
    torch = pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from hybridkv.cli.engine import load_llm
    from hybridkv.serve.server import BackgroundServer

    torch.set_num_threads(1)  # a tiny model: more threads only fight over small CI machines
    with BackgroundServer(load_llm("demo", **DEMO_ARGS), "demo") as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(server):
    """The server's engine configuration, used offline."""
    from hybridkv.cli.engine import load_llm

    return load_llm("demo", **DEMO_ARGS)


@pytest.fixture()
def client(server):
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c

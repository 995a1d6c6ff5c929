"""``/openapi.json`` tells the truth: every route's request and response models, the
error shape of its 400 / 404 / 413 answers, ``/metrics`` as text/plain; and
schemathesis (an OpenAPI fuzzer: positive and negative bodies, wrong methods) finds no
failure against a live server on 127.0.0.1.

One check is left out: ``positive_data_acceptance`` expects 2xx for every body the
schema allows, but a schema cannot state cross-field limits such as prompt tokens +
max_tokens <= max_model_len or token ids below the vocabulary size; OpenAI and vLLM
answer those 400 too (with the limit in the message). Every other check runs.

The server is the demo main model alone with max_model_len 48, so any generated
request is a small amount of work (a few tens of seconds for the whole fuzz run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")


pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def small_server():
    torch = pytest.importorskip("torch")
    from hybridkv.cli.engine import load_llm
    from hybridkv.serve.server import BackgroundServer

    torch.set_num_threads(1)
    with BackgroundServer(load_llm("demo", max_model_len=MAX_MODEL_LEN), "demo") as srv:
        yield srv


@pytest.fixture(scope="module")
def openapi(small_server) -> dict:
    return httpx.get(small_server.url + "/openapi.json").json()


def test_every_route_documents_its_request_and_responses(openapi):
    paths = openapi["paths"]
    assert set(paths) == {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/completions",
        "/v1/chat/completions",
    }
    for path, body_model, response_model in (
        ("/v1/completions", "CompletionBody", "CompletionResponse"),
        ("/v1/chat/completions", "ChatBody", "ChatCompletionResponse"),
    ):
        post = paths[path]["post"]
        assert post["requestBody"]["required"] is True
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{body_model}"}
        ok = post["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(response_model)
        assert "text/event-stream" in ok
        for status in ("400", "404", "413"):
            error = post["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "422" not in post["responses"]  # validation answers 400 here
    body = openapi["components"]["schemas"]["CompletionBody"]
    assert body["additionalProperties"] is False and body["required"] == ["prompt"]
    assert body["properties"]["logprobs"]["anyOf"][0]["maximum"] == 20
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    model = paths["/v1/models/{model_id}"]["get"]["responses"]
    assert model["404"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert "HTTPValidationError" not in openapi["components"]["schemas"]


def test_schemathesis_finds_no_failure(small_server, tmp_path):
    """schemathesis' command line, as a user runs it, every phase (examples, coverage:
    boundary values and wrong methods, fuzzing, stateful), a fixed seed, bounded."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        small_server.url + "/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        "5",
        "--seed",
        "1",
        "--suppress-health-check",
        "all",
        "--request-timeout",
        "30",
        "--no-color",
    ]
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "0 failures" in run.stdout or " passed" in run.stdout

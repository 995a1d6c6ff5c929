"""`hybridkv serve` through a real HTTP client against a uvicorn server on localhost (the
demo pair with speculative decoding): OpenAI-shaped completions and chat, streamed and
whole, equal to offline `LLM.generate`; concurrent streams; stop strings; usage;
disconnects free blocks; cache_salt isolates tenants; /metrics, /health, /v1/models."""

from __future__ import annotations

import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_support import metrics, wait_idle  # noqa: E402

from hybridkv.demo import HEADER, demo_prompts  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402
from hybridkv.serve.chat import render_demo_chat  # noqa: E402

pytestmark = pytest.mark.engine

MODEL = "demo"


def sse_events(response) -> list[str]:
    """The ``data:`` payloads of a server-sent-event response, in order; checks framing."""
    payloads = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payloads.append(line[len("data: ") :])
    return payloads


def stream(client, path: str, body: dict) -> tuple[list[dict], str]:
    """(parsed chunks, the last payload) of a streamed request."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_events(response)
    return [json.loads(p) for p in payloads[:-1]], payloads[-1]


def offline_text(offline, prompt, max_tokens: int, **kwargs) -> tuple[str, list[int], str]:
    result = offline.generate([prompt], max_tokens, temperature=0.0, **kwargs)[0]
    return result.text, result.token_ids, result.finish_reason


# ---------------------------------------------------------------------- basics
def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 4096


def test_completion_equals_offline_generate_with_usage(client, offline):
    prompt = HEADER + "def main("
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    out = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    text, ids, reason = offline_text(offline, prompt, 40)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    choice = out["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (text, ids, reason)
    cached = out["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < len(prompt.encode())
    assert out["usage"] == {
        "prompt_tokens": len(prompt.encode()),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt.encode()) + len(ids),
    }
    # A token-id prompt (and a list of one prompt) means the same request.
    by_ids = client.post("/v1/completions", json={**body, "prompt": [list(prompt.encode())]})
    assert by_ids.json()["choices"][0]["text"] == text


def test_stream_chunks_concatenate_to_the_whole_text_and_end_with_done(client):
    body = {"prompt": "import os\n", "max_tokens": 30, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    chunks, last = stream(
        client, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert last == "[DONE]"
    *text_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    reasons = [c["choices"][0]["finish_reason"] for c in text_chunks]
    assert reasons[:-1] == [None] * (len(reasons) - 1)
    assert reasons[-1] == whole["choices"][0]["finish_reason"]
    # the stream may hit the blocks the whole request cached: only that may differ
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    for usage in (usage_chunk["usage"], whole["usage"]):
        usage.pop("prompt_tokens_details")
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


def test_concurrent_streams_get_exactly_the_offline_greedy_text(server, offline):
    """8 clients stream at once (continuous batching, shared prefix, speculation); each
    gets the text and tokens `LLM.generate` gives offline for its prompt."""
    prompts = demo_prompts(8)
    results = offline.generate(prompts, 32, temperature=0.0)
    expected = [(r.text, r.token_ids, r.finish_reason) for r in results]
    start = threading.Barrier(len(prompts))
    got: list = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            fetch(i)
        except Exception as err:  # reported by the comparison below
            got[i] = err

    def fetch(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            start.wait()
            body = {"prompt": prompts[i], "max_tokens": 32, "temperature": 0}
            chunks, last = stream(c, "/v1/completions", {**body, "return_token_ids": True})
            got[i] = (
                "".join(ch["choices"][0]["text"] for ch in chunks),
                [t for ch in chunks for t in ch["choices"][0]["token_ids"]],
                chunks[-1]["choices"][0]["finish_reason"],
                last,
            )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [g if isinstance(g, Exception) else g[3] for g in got] == ["[DONE]"] * len(prompts)
    assert [g[:3] for g in got] == [tuple(e) for e in expected]


def test_sampling_with_a_seed_is_reproducible_and_matches_offline(client, offline):
    """temperature > 0 with a seed: the request's random stream is its own (seeded by
    the seed alone), so the server repeats itself and agrees with `LLM.generate`."""
    prompt = HEADER + "def count_words(text):\n"
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0.8, "seed": 1234}
    first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    chunks, _ = stream(client, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == first
    expected = offline.generate([prompt], 24, temperature=0.8, seed=1234)[0].text
    assert first == expected


# ---------------------------------------------------------------------- chat
def test_chat_uses_the_demo_template_streamed_and_whole(client, offline):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": [{"type": "text", "text": "A function that reads a file"}]},
    ]
    body = {"messages": messages, "max_tokens": 32, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=body).json()
    rendered = render_demo_chat(
        [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "A function that reads a file"},
        ]
    )
    text, _, reason = offline_text(offline, rendered, 32)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert whole["choices"][0]["finish_reason"] == reason
    assert whole["usage"]["prompt_tokens"] == len(rendered.encode())
    chunks, last = stream(client, "/v1/chat/completions", body)
    assert last == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == text
    assert chunks[-1]["choices"][0]["finish_reason"] == reason


# ---------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("streamed", [False, True])
def test_stop_string_cuts_the_text_and_finishes_with_stop(client, offline, streamed):
    prompt = HEADER + "def walk(root):\n"
    full, _, _ = offline_text(offline, prompt, 60, ignore_eos=True)
    stop = full[12:15]  # a string the greedy text contains; cut at its first occurrence
    assert stop and stop in full
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "stop": ["\x00never", stop]}
    if streamed:
        chunks, last = stream(client, "/v1/completions", body)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
        assert last == "[DONE]"
    else:
        out = client.post("/v1/completions", json=body).json()
        text, reason = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
    assert (text, reason) == (full[: full.index(stop)], "stop")


# ---------------------------------------------------------------------- bad requests
LONG = "x" * 5000  # byte tokenizer: 5000 tokens > max_model_len 4096

BAD_COMPLETIONS = [
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "temperature": -0.5}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", [97]]}, "prompt"),  # texts and id lists mixed
    ({"prompt": ["a"] * 65, "n": 2}, "n"),  # 130 choices > 128
    ({"prompt": [300]}, "prompt"),
    ({"prompt": LONG}, "prompt"),
    ({"prompt": "x" * 4000, "max_tokens": 200}, "max_tokens"),
    ({"prompt": "a", "foo": 1}, "foo"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "min_p": 1.5}, "min_p"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "cache_salt": 7}, "cache_salt"),
    ({"prompt": "a", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "a", "seed": 1.5}, "seed"),
]


def check_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
@pytest.mark.parametrize("streamed", [False, True])
def test_bad_completion_requests_get_400_naming_the_field(client, body, param, streamed):
    if streamed and "stream" not in body:
        body = {**body, "stream": True}
    error = check_error(client.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"max_tokens": 4}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("body, param", BAD_CHATS)
def test_bad_chat_requests_get_400_naming_the_field(client, body, param):
    check_error(client.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_bodies_unknown_models_and_routes(client):
    check_error(client.post("/v1/completions", content=b"{"), 400, None)
    check_error(client.post("/v1/completions", json=["a"]), 400, None)
    check_error(
        client.post("/v1/completions", json={"model": "gpt-x", "prompt": "a"}), 404, "model"
    )
    check_error(client.get("/v1/nothing"), 404, None)
    error = client.get("/v1/completions")
    check_error(error, 405, None)
    assert error.headers["allow"] == "POST"
    check_error(client.post("/v1/completions", content=b"x" * (33 << 20)), 413, None)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_an_openai_413_with_a_code(client, chunked):
    """A 60 MB body got a garbled message ("is more than over the limit") and code null
    when it arrived without a Content-Length; both ways now say the limit and the fix."""
    body = b"x" * (60 << 20)
    if chunked:  # no Content-Length: found over the limit while it streams in
        content = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))
        response = client.post("/v1/completions", content=content)
    else:
        response = client.post("/v1/completions", content=body)
    error = check_error(response, 413, None)
    assert error["code"] == "request_too_large"
    assert error["type"] == "invalid_request_error"
    assert "limit of 33554432 bytes (32 MiB)" in error["message"], error["message"]
    assert "split a batch" in error["message"]
    if not chunked:
        assert error["message"].startswith(f"the request body is {len(body)} bytes, over")


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([1, -2], "prompt[1] = -2 is a negative token id"),
        (["x", ""], "prompt[1] is an empty string"),
        ([[5, 6], [-1]], "prompt[1][0] = -1 is a negative token id"),
        ([[]], "prompt[0] is an empty list"),
        ([1.5], "prompt must be a text, a list of token ids"),
    ],
)
def test_bad_prompts_say_what_is_wrong(client, prompt, needle):
    """Both used to answer "should be a valid string" (the first form of the union)."""
    error = check_error(client.post("/v1/completions", json={"prompt": prompt}), 400, "prompt")
    assert needle in error["message"], error["message"]
    assert "valid string" not in error["message"]


@pytest.mark.parametrize("path", ["/metrics", "/health", "/v1/models", f"/v1/models/{MODEL}"])
def test_head_answers_on_get_routes(client, path):
    """AIPerf probes HEAD /metrics; HEAD was a 405 on every GET route."""
    got = client.get(path)
    head = client.head(path)
    assert head.status_code == got.status_code == 200, head.text
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_head_on_a_post_route_is_405_listing_post(client):
    response = client.head("/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"


# ---------------------------------------------------------------------- disconnects
def test_stream_disconnect_cancels_and_frees_blocks(server, client):
    idle = wait_idle(client, 0.0)
    assert idle["hybridkv:kv_cache_usage_perc"] == 0.0
    body = {"prompt": HEADER, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: ")
        busy = metrics(client)
        assert busy["hybridkv:num_requests_running"] == 1
        assert busy["hybridkv:kv_cache_usage_perc"] > 0
    after = wait_idle(client, 0.0)
    assert after["hybridkv:num_requests_running"] == 0
    assert after["hybridkv:kv_cache_usage_perc"] == 0.0
    assert (
        after["hybridkv:request_success_total[abort]"]
        == idle["hybridkv:request_success_total[abort]"] + 1
    )
    assert (
        after["hybridkv:generation_tokens_total"] - idle["hybridkv:generation_tokens_total"] < 3000
    )
    server.engine.call(server.engine.check_invariants).result(timeout=30)


def test_non_streaming_client_that_gives_up_cancels_its_request(server, client):
    idle = wait_idle(client, 0.0)
    body = {"prompt": HEADER, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    after = wait_idle(client, 0.0)
    assert after["hybridkv:kv_cache_usage_perc"] == 0.0
    assert (
        after["hybridkv:request_success_total[abort]"]
        == idle["hybridkv:request_success_total[abort]"] + 1
    )
    server.engine.call(server.engine.check_invariants).result(timeout=30)


# ---------------------------------------------------------------------- cache, metrics
def hits_after(client, prompt: str, salt: str | None) -> float:
    """Prefix-cache hit tokens that one request with ``salt`` added."""
    before = metrics(client)["hybridkv:prefix_cache_hits_total"]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    assert client.post("/v1/completions", json=body).status_code == 200
    return metrics(client)["hybridkv:prefix_cache_hits_total"] - before


def test_cache_salt_isolates_tenants(client):
    prompt = "# tenant isolation\n" + HEADER  # not sent by any other test
    assert hits_after(client, prompt, "tenant-a") == 0
    assert hits_after(client, prompt, "tenant-b") == 0  # same prompt, other salt: no hit
    assert hits_after(client, prompt, None) == 0  # no salt is a tenant of its own
    assert hits_after(client, prompt, "tenant-a") > 0
    assert hits_after(client, prompt, "tenant-b") > 0


def test_metrics_count_queries_hits_tokens_and_drafts(client):
    prompt = "# metrics\n" + HEADER
    m0 = metrics(client)
    for _ in range(2):
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
    m1 = metrics(client)
    delta = {k: m1[k] - m0[k] for k in m0}
    num_prompt = len(prompt.encode())
    assert delta["hybridkv:prefix_cache_queries_total"] == 2 * num_prompt
    assert 0 < delta["hybridkv:prefix_cache_hits_total"] < num_prompt
    assert delta["hybridkv:prompt_tokens_total"] == 2 * num_prompt
    assert delta["hybridkv:generation_tokens_total"] == 48
    assert delta["hybridkv:spec_decode_num_draft_tokens_total"] > 0
    assert (
        0
        < delta["hybridkv:spec_decode_num_accepted_tokens_total"]
        <= delta["hybridkv:spec_decode_num_draft_tokens_total"]
    )
    assert delta["hybridkv:request_success_total[length]"] == 2
    assert delta["hybridkv:time_to_first_token_seconds_count"] == 2
    assert delta["hybridkv:e2e_request_latency_seconds_count"] == 2
    assert (
        m1["hybridkv:e2e_request_latency_seconds_sum"]
        > m0["hybridkv:e2e_request_latency_seconds_sum"]
    )
    text = client.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE hybridkv:prefix_cache_hits_total counter" in text.text


# ---------------------------------------------------------------------- engine errors
def test_an_engine_error_mid_request_is_clean_json_and_the_loop_recovers(
    server, client, monkeypatch
):
    """A typed error raised by an engine step fails that step's requests with OpenAI's
    error body (whole: HTTP 400; streamed: an error event, then [DONE]); the requests
    are cancelled, their blocks freed, and the next request is served normally."""
    llm = server.engine.llm
    real_step = llm.step
    failures = iter([EngineError("injected step failure"), EngineError("injected again")])

    def failing_step():
        err = next(failures, None)
        if err is not None:
            raise err
        return real_step()

    monkeypatch.setattr(llm, "step", failing_step)
    body = {"prompt": HEADER, "max_tokens": 8, "temperature": 0}
    error = check_error(client.post("/v1/completions", json=body), 400, None)
    assert "injected step failure" in error["message"] and error["code"] == "engine_error"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        payloads = sse_events(response)
    assert json.loads(payloads[0])["error"]["message"].endswith("injected again")
    assert payloads[-1] == "[DONE]"
    monkeypatch.undo()
    assert client.post("/v1/completions", json=body).json()["choices"][0]["finish_reason"]
    assert wait_idle(client, 0.0)["hybridkv:kv_cache_usage_perc"] == 0.0
    server.engine.call(server.engine.check_invariants).result(timeout=30)


def test_a_bug_after_a_step_is_a_500_and_the_loop_keeps_serving(server, client, monkeypatch):
    """An unexpected exception in the loop (here: reading a result) fails the requests
    in flight with a 500 ``server_error`` body; the thread survives and serves on."""
    llm = server.engine.llm

    def broken_result(request):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(llm, "result", broken_result)
    body = {"prompt": HEADER, "max_tokens": 8, "temperature": 0}
    error = check_error(client.post("/v1/completions", json=body), 500, None)
    assert error["type"] == "server_error" and "injected bug" in error["message"]
    monkeypatch.undo()
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert wait_idle(client, 0.0)["hybridkv:kv_cache_usage_perc"] == 0.0
    server.engine.call(server.engine.check_invariants).result(timeout=30)


def test_a_mixed_crowd_with_disconnects_leaves_the_engine_clean(server, client):
    """16 clients at once, a fixed mix: streamed or whole, greedy or sampled, with and without
    stop strings and salts, some hanging up after a few chunks or after a short timeout,
    some sending bad bodies. Every completed answer is well formed; afterwards nothing
    runs, no block is held and every invariant holds."""
    idle = wait_idle(client, 0.0)
    prompts = demo_prompts(8)
    ways = [("stream", None), ("stream", 1), ("stream", 3), ("whole", None), ("whole", 0.3)]
    plans = []
    for i in range(16):
        way, hang_up_after = ways[i % len(ways)]
        body = {
            "prompt": prompts[i % len(prompts)],
            "max_tokens": (24, 160, 4)[i % 3],
            "temperature": (0, 0.7)[i % 2],
            "seed": i,
            "ignore_eos": True,
        }
        if i % 4 == 3:
            body["stop"] = ["\n\n"]
        if i % 3:
            body["cache_salt"] = "ab"[i % 2]
        plans.append(
            {
                "stream": way == "stream",
                "hang_up_after": hang_up_after,
                "bad": i % 7 == 6,
                "body": body,
            }
        )
    # Hang-ups that cannot finish first: 160 tokens, no stop string, a hang-up planned.
    sure = sum(
        1
        for p in plans
        if p["hang_up_after"]
        and not p["bad"]
        and p["body"]["max_tokens"] == 160
        and "stop" not in p["body"]
    )
    problems: list[str] = []
    hung_up = []
    gate = threading.Barrier(len(plans))

    def run(plan: dict) -> None:
        body = dict(plan["body"])
        if plan["bad"]:
            body["max_tokens"] = -3
        with httpx.Client(base_url=server.url, timeout=60) as c:
            gate.wait()
            if not plan["stream"]:
                timeout = plan["hang_up_after"] or 60
                try:
                    r = c.post("/v1/completions", json=body, timeout=timeout)
                except httpx.ReadTimeout:
                    hung_up.append(plan)
                    return
                ok = r.status_code == (400 if plan["bad"] else 200)
                if not ok or (not plan["bad"] and r.json()["choices"][0]["finish_reason"] is None):
                    problems.append(f"whole: {r.status_code} {r.text[:200]}")
                return
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                if plan["bad"]:
                    if r.status_code != 400:
                        problems.append(f"bad stream answered {r.status_code}")
                    return
                events = []
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                    if plan["hang_up_after"] and len(events) >= plan["hang_up_after"]:
                        hung_up.append(plan)
                        return
                if events[-1] != "data: [DONE]":
                    problems.append(f"stream ended with {events[-1][:100]}")

    threads = [threading.Thread(target=run, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert problems == []
    assert sure >= 2 and len(hung_up) >= sure  # the mix does exercise disconnects
    after = wait_idle(client, 0.0)
    assert after["hybridkv:num_requests_running"] == 0
    assert after["hybridkv:num_requests_waiting"] == 0
    assert after["hybridkv:kv_cache_usage_perc"] == 0.0
    finished = sum(
        after[f"hybridkv:request_success_total[{r}]"] - idle[f"hybridkv:request_success_total[{r}]"]
        for r in ("stop", "length", "abort")
    )
    assert finished == sum(not p["bad"] for p in plans)
    queries = (
        after["hybridkv:prefix_cache_queries_total"] - idle["hybridkv:prefix_cache_queries_total"]
    )
    hits = after["hybridkv:prefix_cache_hits_total"] - idle["hybridkv:prefix_cache_hits_total"]
    assert 0 < hits <= queries
    server.engine.call(server.engine.check_invariants).result(timeout=30)


def test_max_model_len_flag_sets_the_served_limit():
    """`--max-model-len` (through the CLI's loader) is the limit /v1/models reports and
    the length checks enforce, with the numbers in the message."""
    from hybridkv.cli.engine import load_llm
    from hybridkv.serve.server import BackgroundServer

    llm = load_llm("demo", max_model_len=256)
    with BackgroundServer(llm, "small") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 256
        body = {"model": "small", "prompt": "x" * 250, "max_tokens": 7}
        error = check_error(c.post("/v1/completions", json=body), 400, "max_tokens")
        assert "250 prompt tokens" in error["message"] and "at most 6" in error["message"]
        ok = c.post("/v1/completions", json={**body, "max_tokens": 6, "temperature": 0})
        assert ok.json()["usage"]["total_tokens"] <= 256

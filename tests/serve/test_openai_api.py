"""The OpenAI surface that evaluation and load tools use, against a real server (the demo
pair: Qwen3.5-style hybrid main model, draft model proposing K = 4 per step):

- lm-eval's loglikelihood request (``echo`` + ``logprobs: 1`` + ``max_tokens`` 1, as
  lm-eval sends it, or 0), read the way lm-eval reads it; prompt logprobs equal
  transformers' float32 log-softmax, also when the prompt's blocks are in the prefix
  cache (prompt-logprob requests skip the lookup);
- the openai SDK: ``models.retrieve``, completions with logprobs, ``n`` and a list of
  prompts, chat with ``logprobs`` / ``top_logprobs``, the sampling options through
  ``extra_body``; ``usage.prompt_tokens_details.cached_tokens``;
- streams of several choices with logprobs and usage.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from hybridkv.demo import HEADER  # noqa: E402
from hybridkv.serve.schemas import ChatCompletionResponse, CompletionResponse  # noqa: E402

pytestmark = pytest.mark.engine

MODEL = "demo"
ATOL = 1e-4  # float32 logits of the same weights, different kernels


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(server):
    """transformers' model of the served main checkpoint, float32."""
    path = server.engine.llm.model_path
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_rows(hf, ids: list[int]) -> torch.Tensor:
    """log-softmax rows ``[len(ids), vocab]``: row i scores the token after position i."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def hf_greedy(hf, ids: list[int], num_new: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=num_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


# ---------------------------------------------------------------------- models
def test_models_retrieve_and_an_unknown_id_is_openais_404(sdk):
    card = sdk.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "hybridkv")
    with pytest.raises(openai.NotFoundError) as err:
        sdk.models.retrieve("gpt-nothing")
    error = err.value.body
    assert error["type"] == "not_found_error" and "gpt-nothing" in error["message"]


# ---------------------------------------------------------------------- lm-eval
def lm_eval_parse(choice: dict, ctxlen: int, generated: int) -> tuple[float, bool]:
    """lm-eval's local-completions `parse_logprobs` for one choice (the last
    ``generated`` entries are the generated token, which it drops)."""
    end = len(choice["logprobs"]["token_logprobs"]) - generated
    values = choice["logprobs"]["token_logprobs"][ctxlen:end]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
    return sum(values), all(v == max(top.values()) for v, top in zip(values, tops, strict=True))


def test_lm_eval_loglikelihood_equals_transformers_after_a_prefix_hit(client, hf):
    """Batched token prompts (context + continuation, 250+ tokens: several 64-token state
    blocks), as lm-eval sends them. The prompts' blocks are cached first (a plain repeat
    hits them); the echo request still scores every prompt token, equal to transformers,
    and reports no cached tokens."""
    pairs = [
        (HEADER + "def add(a, b):\n    return", " a + b\n"),
        (HEADER + "import os\nimport sys\n", "import re"),
    ]
    context = HEADER + "class Stack:\n    def push(self, item):\n"
    greedy = hf_greedy(hf, list(context.encode()), 4)
    pairs.append((context, bytes(greedy).decode()))  # the greedy continuation: is_greedy
    prompts = [list((c + x).encode()) for c, x in pairs]
    ctxlens = [len(c.encode()) for c, _ in pairs]
    plain = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0}
    client.post("/v1/completions", json=plain).raise_for_status()
    hit = client.post("/v1/completions", json=plain).json()["usage"]["prompt_tokens_details"]
    assert hit["cached_tokens"] > 0  # the blocks are in the cache
    for max_tokens in (1, 0):
        body = {
            "model": MODEL,
            "prompt": prompts,
            "temperature": 0,
            "max_tokens": max_tokens,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        out = client.post("/v1/completions", json=body).json()
        CompletionResponse.model_validate(out)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["usage"]["completion_tokens"] == max_tokens * len(prompts)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        results = []
        for choice, prompt, ctxlen in zip(choices, prompts, ctxlens, strict=True):
            rows = hf_rows(hf, prompt)
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(prompt) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            expected = [float(rows[i - 1, prompt[i]]) for i in range(1, len(prompt))]
            assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(expected, abs=ATOL)
            assert "".join(lp["tokens"][: len(prompt)]) == bytes(prompt).decode()
            assert choice["text"].startswith(bytes(prompt).decode())
            assert lp["text_offset"][: len(prompt)] == list(range(len(prompt)))  # ASCII
            if max_tokens:  # the generated token: greedy, scored by the last prompt row
                assert lp["token_logprobs"][-1] == pytest.approx(float(rows[-1].max()), abs=ATOL)
                assert lp["tokens"][-1] == bytes([int(rows[-1].argmax())]).decode()
            total, is_greedy = lm_eval_parse(choice, ctxlen, max_tokens)
            assert total == pytest.approx(sum(expected[ctxlen - 1 :]), abs=ATOL * len(prompt))
            best = rows[ctxlen - 1 : len(prompt) - 1].argmax(dim=-1).tolist()
            assert is_greedy == (best == prompt[ctxlen:])
            results.append(is_greedy)
        assert results[-1] is True and results[0] is False  # both branches exercised


def test_echo_stream_leads_each_choice_with_its_prompt(client):
    body = {"prompt": ["abc", "xyz"], "max_tokens": 3, "temperature": 0, "echo": True}
    whole = client.post("/v1/completions", json=body).json()
    texts: dict[int, str] = {}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert texts[0].startswith("abc") and texts[1].startswith("xyz")


# ---------------------------------------------------------------------- openai SDK
def test_sdk_completions_with_logprobs_n_and_a_list_of_prompts(sdk, hf):
    prompts = ["def main(", "import os\n"]
    out = sdk.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        n=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    CompletionResponse.model_validate(out.model_dump(exclude_unset=True))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # k = prompt * n + sample
    outputs = []
    for choice in out.choices:
        prompt = list(prompts[choice.index // 2].encode())
        ids = choice.model_dump()["token_ids"]
        assert len(ids) == 6 and len(choice.logprobs.token_logprobs) == 6
        rows = hf_rows(hf, prompt + ids)[len(prompt) - 1 : -1]
        assert ids == rows.argmax(dim=-1).tolist()  # greedy, as transformers
        expected = [float(rows[i, t]) for i, t in enumerate(ids)]
        assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=ATOL)
        for value, top in zip(
            choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True
        ):
            assert len(top) == 2 and max(top.values()) == value  # greedy: the top-1 token
        outputs.append(choice.text)
    assert outputs[0] == outputs[1] and outputs[2] == outputs[3]
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)  # each prompt once
    assert out.usage.completion_tokens == 4 * 6


def test_sdk_chat_with_logprobs_and_top_logprobs(sdk, hf):
    out = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a Python function."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ChatCompletionResponse.model_validate(out.model_dump(exclude_unset=True))
    prompt = out.model_dump()["prompt_token_ids"]
    ids = out.choices[0].model_dump()["token_ids"]
    content = out.choices[0].logprobs.content
    assert len(content) == len(ids) == out.usage.completion_tokens == 5
    rows = hf_rows(hf, prompt + ids)[len(prompt) - 1 : -1]
    for entry, token, row in zip(content, ids, rows, strict=True):
        assert entry.logprob == pytest.approx(float(row[token]), abs=ATOL)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert tops == pytest.approx(row.topk(3).values.tolist(), abs=ATOL)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top one
        assert entry.bytes == [token]  # the byte tokenizer: one byte per token


def test_sdk_sampling_filters_that_leave_one_token_sample_the_greedy_text(sdk):
    """At temperature 1 with drafts verified by speculative sampling, top_k = 1, a tiny
    top_p or min_p = 1 leave only the top token: the text is the greedy one."""
    base = {"model": MODEL, "prompt": "def parse(line):\n", "max_tokens": 12}
    greedy = sdk.completions.create(**base, temperature=0).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        out = sdk.completions.create(**base, temperature=1.0, seed=3, n=2, extra_body=extra)
        assert [c.text for c in out.choices] == [greedy, greedy], extra
    out = sdk.completions.create(**base, temperature=1.0, seed=3, top_p=1e-9)
    assert out.choices[0].text == greedy


def test_repetition_penalty_greedy_equals_transformers(client, hf):
    prompt = list(b"x = 1\nx = 1\nx = 1\nx = 1\n")
    body = {
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "repetition_penalty": 2.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    out = client.post("/v1/completions", json=body).json()
    expected = hf_greedy(hf, prompt, 16, repetition_penalty=2.0)
    assert out["choices"][0]["token_ids"] == expected
    plain = client.post("/v1/completions", json={**body, "repetition_penalty": 1.0}).json()
    assert plain["choices"][0]["token_ids"] != expected  # the penalty changed the output


def test_n_samples_differ_and_a_seed_repeats_them(client):
    body = {"prompt": "import ", "max_tokens": 12, "temperature": 1.5, "n": 3, "seed": 5}
    first = [c["text"] for c in client.post("/v1/completions", json=body).json()["choices"]]
    again = [c["text"] for c in client.post("/v1/completions", json=body).json()["choices"]]
    assert first == again and len(set(first)) > 1


def test_cached_tokens_count_the_prefix_hit(client):
    prompt = "# cached tokens\n" + "x = [i * i for i in range(100)]\n" * 4
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": "cached-tokens"}
    first = client.post("/v1/completions", json=body).json()["usage"]
    second = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0  # a salt of its own
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < len(prompt)


def test_stream_of_two_choices_with_logprobs_and_usage(client):
    body = {"prompt": "def f(x):\n", "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    chunks = []
    with client.stream("POST", "/v1/completions", json=stream_body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    *deltas, last = chunks
    for chunk in deltas:
        CompletionResponse.model_validate(chunk)
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["text"]
        tokens[choice["index"]] += choice["logprobs"]["tokens"]
    for choice in whole["choices"]:
        assert texts[choice["index"]] == choice["text"]
        assert tokens[choice["index"]] == choice["logprobs"]["tokens"]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 16


def test_sdk_chat_stream_of_two_choices_with_logprobs(sdk):
    base = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Sort a list."}],
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    whole = sdk.chat.completions.create(**base)
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    usage = None
    for chunk in sdk.chat.completions.create(
        **base, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                tokens[choice.index] += [e.token for e in choice.logprobs.content]
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert tokens[choice.index] == [e.token for e in choice.logprobs.content]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

"""The torch-free parts of `hybridkv serve`: incremental text and stop strings, body
checks, length limits, the demo chat template, the Prometheus text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.engine.models.tokenizer import ByteTokenizer
from hybridkv.errors import RequestError
from hybridkv.serve.chat import chat_renderer, render_demo_chat
from hybridkv.serve.metrics import Histogram, MetricsSnapshot, parse, render
from hybridkv.serve.prepare import ModelInfo, prepare_chat, prepare_completion
from hybridkv.serve.protocol import MAX_CHOICES, ChatBody, CompletionBody, parse_body
from hybridkv.serve.textstream import TextStream

TOK = ByteTokenizer()


def run_stream(token_ids: list[int], steps: list[int], stop: tuple[str, ...]):
    """Feed ``token_ids`` in pieces of ``steps`` tokens; (sent pieces, stopped)."""
    stream = TextStream(TOK.decode, stop)
    sent, stopped, n = [], False, 0
    for size in steps:
        n = min(len(token_ids), n + size)
        delta = stream.update(token_ids[:n], finished=n == len(token_ids))
        stream.check_invariants()
        sent.append(delta.text)
        stopped = stopped or delta.stopped
        if delta.stopped or n == len(token_ids):
            break
    return sent, stopped


texts = st.text(alphabet=st.sampled_from("ab\n é€😀"), max_size=40)


@given(
    text=texts,
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=60),
    stop=st.lists(st.text(alphabet=st.sampled_from("ab\né"), min_size=1, max_size=3), max_size=2),
)
def test_stream_pieces_add_up_to_the_text_cut_at_the_first_stop(text, steps, stop):
    """Whatever the step sizes (multi-byte characters split across steps included), the
    pieces concatenate to the decoded text, cut before the earliest stop string of the
    first step that completes one (generation ends there: later text never exists)."""
    ids = TOK.encode(text)
    steps = [*steps, len(ids) + 1]  # always reach the end
    sent, stopped = run_stream(ids, steps, tuple(stop))
    expected, n = text, 0
    for size in steps:
        n = min(len(ids), n + size)
        seen = TOK.decode(ids[:n])
        cuts = [i for i in (seen.find(s) for s in stop) if i >= 0]
        if cuts:
            expected = seen[: min(cuts)]
            break
        if n == len(ids):
            break
    assert "".join(sent) == expected
    assert stopped == any(s in text for s in stop)
    assert "\ufffd" not in "".join(sent)  # never half a character


def test_stream_holds_back_a_possible_stop_prefix_until_resolved():
    stream = TextStream(TOK.decode, ("END",))
    ids = TOK.encode("abcEN")
    assert stream.update(ids, finished=False).text == "abc"  # "EN" may start "END"
    assert stream.update(TOK.encode("abcENX"), finished=False).text == "ENX"  # it did not
    assert stream.update(TOK.encode("abcENXyE"), finished=False).text == "y"
    delta = stream.update(TOK.encode("abcENXyEND!"), finished=False)
    assert (delta.text, delta.stopped) == ("", True)
    assert stream.sent == "abcENXy"
    assert stream.update(TOK.encode("abcENXEND!!"), finished=True).text == ""


# ---------------------------------------------------------------------- bodies
INFO = ModelInfo(
    name="demo",
    max_model_len=64,
    vocab_size=TOK.vocab_size,
    encode=TOK.encode,
    render_chat=chat_renderer(TOK, "demo"),
)


def completion(**body):
    return prepare_completion(CompletionBody.model_validate(body), INFO)


def test_limits_name_both_sides_and_the_fix():
    assert completion(prompt="a" * 60, max_tokens=4).max_tokens == 4  # exactly 64: fits
    with pytest.raises(RequestError) as err:
        completion(prompt="a" * 60, max_tokens=5)
    assert err.value.param == "max_tokens" and err.value.status == 400
    assert "60 prompt tokens" in err.value.message and "at most 4" in err.value.message
    with pytest.raises(RequestError) as err:
        completion(prompt="a" * 64)
    assert err.value.param == "prompt" and "64 tokens" in err.value.message


def test_chat_without_max_tokens_may_fill_the_context():
    gen = prepare_chat(
        ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}]}), INFO
    )
    prompt = render_demo_chat([{"role": "user", "content": "hi"}])
    assert list(gen.prompt_token_ids) == TOK.encode(prompt)
    assert gen.max_tokens == INFO.max_model_len - len(prompt)


def test_demo_template_renders_roles_and_ends_with_the_assistant_line():
    text = render_demo_chat(
        [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_a_tokenizer_without_template_refuses_chat_cleanly():
    class NoTemplate:
        def encode(self, text):
            return [1]

    with pytest.raises(RequestError) as err:
        chat_renderer(NoTemplate(), "m")([{"role": "user", "content": "hi"}])
    assert err.value.param == "messages" and "/v1/completions" in err.value.message


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"not json", None),
        (b"[1]", None),
        (b"\xff\xfe{}", None),
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", None),
        (b'{"prompt": "a", "max_tokens": 1e400}', "max_tokens"),
        (b'{"prompt": "a", "temperature": NaN}', "temperature"),
        (b'{"prompt": "a", "temperature": Infinity}', "temperature"),
        (b'{"prompt": "a", "stream_options": {"x": 1}}', "stream_options.x"),
    ],
)
def test_parse_and_check_refuse_with_the_field(raw, param):
    with pytest.raises(RequestError) as err:
        body = parse_body(raw, CompletionBody)
        prepare_completion(body, INFO)
    assert err.value.param == param and err.value.status == 400


def test_unknown_model_is_404():
    with pytest.raises(RequestError) as err:
        completion(prompt="a", model="other")
    assert (err.value.status, err.value.code) == (404, "model_not_found")


# ---------------------------------------------------------------------- metrics
def test_metrics_text_round_trips_with_labels():
    ttft = Histogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        ttft.observe(seconds)
    ttft.check_invariants()
    snap = MetricsSnapshot(
        model_name='m"x',
        num_requests_running=2,
        num_requests_waiting=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        prompt_tokens=100,
        generation_tokens=7,
        spec_draft_tokens=9,
        spec_accepted_tokens=6,
        num_preemptions=0,
        num_steps=5,
        finished={"length": 3},
        time_to_first_token=ttft.snapshot(),
    )
    text = render(snap)
    values = parse(text)
    label = 'model_name="m\\"x"'
    assert values[f"hybridkv:kv_cache_usage_perc{{{label}}}"] == 0.25
    assert values[f"hybridkv:prefix_cache_hits_total{{{label}}}"] == 40
    assert values[f'hybridkv:request_success_total{{{label},finished_reason="length"}}'] == 3
    assert values[f'hybridkv:request_success_total{{{label},finished_reason="abort"}}'] == 0
    # Cumulative buckets, as Prometheus' "le": 0.1 holds 0.05 and 0.1 itself.
    hist = "hybridkv:time_to_first_token_seconds"
    assert values[f'{hist}_bucket{{{label},le="0.1"}}'] == 2
    assert values[f'{hist}_bucket{{{label},le="1.0"}}'] == 3
    assert values[f'{hist}_bucket{{{label},le="+Inf"}}'] == 4
    assert values[f"{hist}_count{{{label}}}"] == 4
    assert values[f"{hist}_sum{{{label}}}"] == pytest.approx(3.65)
    for line in text.splitlines():  # every sample has HELP and TYPE lines above it
        if not line.startswith("#"):
            name = line.split("{")[0]
            base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
            assert f"# TYPE {name} " in text or f"# TYPE {base} histogram" in text


# ---------------------------------------------------------------------- fuzz
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = sorted(set(CompletionBody.model_fields) | set(ChatBody.model_fields) | {"bogus"})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": json_values}
)


@given(
    body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    prompt=st.one_of(
        json_values, st.text(max_size=80), st.lists(st.integers(-5, 300), max_size=80)
    ),
    messages=st.one_of(json_values, st.lists(MESSAGE, max_size=3)),
)
def test_any_body_is_served_or_refused_with_a_request_error(body, prompt, messages):
    """Whatever JSON arrives, preparing it either succeeds within the limits or raises
    `RequestError` (an HTTP 4xx with a field), never anything else."""
    import json

    for model, extra, prepare in (
        (CompletionBody, {"prompt": prompt}, prepare_completion),
        (ChatBody, {"messages": messages}, prepare_chat),
    ):
        raw = json.dumps({**extra, **body}).encode()
        try:
            gen = prepare(parse_body(raw, model), INFO)
        except RequestError as err:
            assert 400 <= err.status < 500 and err.message
            continue
        assert gen.max_tokens >= (0 if gen.echo else 1)
        assert 1 <= gen.num_choices <= MAX_CHOICES
        for prompt in gen.prompts:
            assert len(prompt) >= 1 and len(prompt) + gen.max_tokens <= 64
            assert all(0 <= t < TOK.vocab_size for t in prompt)
        assert gen.temperature >= 0


# ---------------------------------------------------------------------- logprob shapes
def test_token_strings_are_distinct_text_for_every_byte_id():
    from hybridkv.serve.logprobs import TokenTexts

    texts = TokenTexts(TOK)
    strings = [texts.text(t) for t in range(TOK.vocab_size)]
    texts.check_invariants()
    assert len(set(strings)) == TOK.vocab_size
    assert texts.text(ord("a")) == "a" and texts.bytes(ord("a")) == [97]
    assert texts.text(0xE2) == "bytes:\\xe2" and texts.bytes(0xE2) == [0xE2]
    assert texts.text(TOK.eos_token_id).startswith("<")


def test_echo_response_pairs_prompt_and_output_logprobs():
    """Whole and streamed bodies of a 2-prompt x n=2 echo request with logprobs."""
    from hybridkv.engine.sampling.logprobs import TokenLogprob
    from hybridkv.serve.engine_loop import Output
    from hybridkv.serve.logprobs import TokenTexts
    from hybridkv.serve.responses import ResponseFormat

    gen = completion(prompt=["ab", "xyz"], n=2, echo=True, logprobs=1, max_tokens=1)
    fmt = ResponseFormat(False, "demo", gen, TokenTexts(TOK))

    def lp(token: int) -> TokenLogprob:
        return TokenLogprob(token, -1.0, 2, ((ord("q"), -0.5),))

    for k in range(gen.num_choices):
        prompt = gen.choice_prompt(k)
        event = Output(
            "!",
            (ord("!"),),
            "length",
            len(prompt),
            1,
            index=k,
            logprobs=(lp(ord("!")),),
            prompt_logprobs=(None, *[lp(t) for t in prompt[1:]]),
        )
        chunk = fmt.add(event)
        assert chunk is not None and chunk["choices"][0]["index"] == k
        fmt.check_invariants()
    whole = fmt.whole()
    texts = [c["text"] for c in whole["choices"]]
    assert texts == ["ab!", "ab!", "xyz!", "xyz!"]
    first = whole["choices"][2]["logprobs"]
    assert first["tokens"] == ["x", "y", "z", "!"] and first["text_offset"] == [0, 1, 2, 3]
    assert first["token_logprobs"] == [None, -1.0, -1.0, -1.0]
    assert first["top_logprobs"][0] is None and first["top_logprobs"][1] == {"q": -0.5, "y": -1.0}
    assert whole["usage"]["prompt_tokens"] == 5 and whole["usage"]["completion_tokens"] == 4


def test_serving_docs_match_what_the_server_accepts():
    """docs/serving.md said `n != 1`, several prompts, logprobs, top_p and penalties were
    refused or not built; all of them work. Every body field is documented, and the
    "Not built" list names none of them."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    serving = (docs / "serving.md").read_text()
    both = serving + (docs / "openai_api.md").read_text()
    fields = set(CompletionBody.model_fields) | set(ChatBody.model_fields)
    for name in sorted(fields - {"stream_options"}):  # documented as stream_options.x
        assert f"`{name}`" in both, name
    assert "`stream_options.include_usage`" in both
    not_built = " ".join(serving.split("Not built:")[1].split("\n\n")[0].split())
    for feature in ("prompt", "choice", "logprob", "log probabilities", "top_p", "penalt"):
        assert feature not in not_built, (feature, not_built)
    flat = " ".join(serving.split())
    for wrong in ("n != 1", "stops, several prompts in one request", "temperature only"):
        assert wrong not in flat, wrong

"""Chat messages through a Hugging Face tokenizer's own chat template: the server's
prompt ids are the tokenizer's rendering with the generation prompt, encoded without a
second set of special tokens; a template that raises is a 400 on ``messages``. End to
end on a tiny random Qwen3 checkpoint that ships this tokenizer: the server's tokens
equal `LLM.generate`'s and its text is their decoding without special tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from hybridkv.errors import RequestError  # noqa: E402
from hybridkv.serve.chat import chat_renderer  # noqa: E402

pytestmark = pytest.mark.engine

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('no tool role') }}{% endif %}"
    "<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


WORDS = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":", "hi", "there"]
WORDS += [f"w{i}" for i in range(16 - len(WORDS))]  # 16 ids: the model's vocabulary


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A folder with a tiny random Qwen3 (vocabulary 16, EOS = "</s>") and a word-level
    tokenizer with a chat template, as `hybridkv serve FOLDER` would get it."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        eos_token_id=WORDS.index("</s>"),
    )
    folder = tmp_path_factory.mktemp("hf_ckpt")
    transformers.Qwen3ForCausalLM(config).float().save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    """The checkpoint's tokenizer loaded back the way the server loads it."""
    return AutoTokenizer.from_pretrained(checkpoint)


def build_tokenizer() -> PreTrainedTokenizerFast:
    words = WORDS
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"</?s>|:"), "isolated"),
            tokenizers.pre_tokenizers.Whitespace(),
        ]
    )
    raw.add_special_tokens(["<s>", "</s>"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = TEMPLATE
    return tok


def test_messages_render_with_the_tokenizers_template(hf_tokenizer):
    render = chat_renderer(hf_tokenizer, "m")
    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": "hi there"}]
    ids = render(messages)
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<s>assistant:")
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.convert_ids_to_tokens(ids)[:4] == ["<s>", "system", ":", "hi"]


def test_a_template_that_raises_is_a_400_on_messages(hf_tokenizer):
    with pytest.raises(RequestError) as err:
        chat_renderer(hf_tokenizer, "m")([{"role": "tool", "content": "x"}])
    assert err.value.param == "messages" and err.value.status == 400
    assert "no tool role" in err.value.message


def test_the_server_speaks_through_the_checkpoints_tokenizer(checkpoint, hf_tokenizer):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from hybridkv.engine import LLM
    from hybridkv.serve.server import BackgroundServer

    messages = [{"role": "user", "content": "hi there"}]
    rendered = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = hf_tokenizer.encode(rendered, add_special_tokens=False)
    expected = LLM(checkpoint).generate([prompt_ids], 6, ignore_eos=True)[0].token_ids
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with BackgroundServer(LLM(checkpoint), "tiny") as srv, httpx.Client(base_url=srv.url) as c:
        chat = c.post("/v1/chat/completions", json={**body, "messages": messages}).json()
        plain = c.post("/v1/completions", json={**body, "prompt": "hi there hi"}).json()
    assert chat["prompt_token_ids"] == prompt_ids
    assert chat["choices"][0]["token_ids"] == expected
    text = hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert chat["choices"][0]["message"]["content"] == text
    assert plain["prompt_token_ids"] == hf_tokenizer.encode("hi there hi")
    assert plain["usage"]["completion_tokens"] == 6

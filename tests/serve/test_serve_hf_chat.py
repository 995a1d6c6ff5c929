"""Chat messages through a Hugging Face tokenizer's own chat template: the server's
prompt ids are the tokenizer's rendering with the generation prompt, encoded without a
second set of special tokens; a template that raises is a 400 on ``messages``."""

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


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A tiny word-level tokenizer with a chat template, saved and loaded back the way
    the server loads a checkpoint's tokenizer."""
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":", "hi", "there"]
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
    folder = tmp_path_factory.mktemp("hf_tok")
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


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

"""Chat messages -> prompt token ids.

A checkpoint whose tokenizer carries a chat template (a Hugging Face tokenizer with
``chat_template``) is rendered by the tokenizer's own ``apply_chat_template`` with the
generation prompt added, then encoded without adding special tokens again (the template
writes them).

The demo models use the byte tokenizer, which has no template; they get
a minimal documented template (`render_demo_chat`). Each message is a role line and its
content, and the prompt ends with the assistant's role line::

    <|system|>
    You are terse.
    <|user|>
    Write a Python main function.
    <|assistant|>

(``developer`` messages render as ``system``.) The demo models were trained on code,
not on chats, so their answers are continuations, not conversation; the template
exists so that chat clients work end to end and the path is tested.

Any other tokenizer without a template: chat requests get a 400 saying to use
/v1/completions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridkv.errors import RequestError


def render_demo_chat(messages: list[dict[str, str]]) -> str:
    """The demo template (module doc) as text."""
    lines = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        lines.append(f"<|{role}|>\n{message['content']}\n")
    return "".join(lines) + "<|assistant|>\n"


def chat_renderer(tokenizer: Any, model_name: str) -> Callable[[list[dict[str, str]]], list[int]]:
    """``messages -> prompt ids`` for ``tokenizer`` (module doc)."""
    if tokenizer is None:
        return _refuse(f"model {model_name!r} has no tokenizer, so it cannot take chat messages")
    if getattr(tokenizer, "chat_template", None):
        return lambda messages: _apply_hf_template(tokenizer, messages)
    if getattr(tokenizer, "name", None) == "bytes":
        return lambda messages: list(tokenizer.encode(render_demo_chat(messages)))
    return _refuse(f"model {model_name!r} has a tokenizer without a chat template")


def _apply_hf_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # a template may raise anything (jinja raise_exception, ...)
        raise RequestError(
            f"the model's chat template refused these messages: {err}",
            param="messages",
            code="chat_template_error",
        ) from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _refuse(reason: str) -> Callable[[list[dict[str, str]]], list[int]]:
    def refuse(messages: list[dict[str, str]]) -> list[int]:
        raise RequestError(
            f"{reason}; send a plain prompt to /v1/completions instead",
            param="messages",
            code="no_chat_template",
        )

    return refuse

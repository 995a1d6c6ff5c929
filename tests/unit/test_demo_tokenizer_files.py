"""The demo models' tokenizer files: Hugging Face loaders and the engine agree id for id.

``scripts/make_demo_tokenizer.py`` writes ``tokenizer.json`` + ``tokenizer_config.json``
into each demo folder; ``transformers.AutoTokenizer``, ``tokenizers.Tokenizer`` and the
engine's `ByteTokenizer` (which reads the same files) must encode, decode and apply the
chat template exactly alike, offline.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from transformers import AutoTokenizer

from hybridkv.demo import DEMO_DRAFT, DEMO_MAIN, DEMO_MTP
from hybridkv.engine.models.tokenizer import ByteTokenizer, load_tokenizer
from hybridkv.errors import EngineError
from hybridkv.serve.chat import render_demo_chat

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "",
    "def f(x):\n    return x + 1  # café ✓\n",
    "naïve 日本語 Ελληνικά עברית 🎉👩‍👩‍👧 \u200b\t\r\n",
    "  leading spaces and trailing  ",
    "literal specials: <bos> <eos> <pad> <reserved_260> <|user|>",
    "\x00\x01\x7f control bytes",
]
MESSAGES = [
    {"role": "system", "content": "You are terse. ✓"},
    {"role": "developer", "content": "Answer in Python."},
    {"role": "user", "content": "Write a main function <eos>."},
    {"role": "assistant", "content": "def main():"},
    {"role": "user", "content": "日本"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")  # the files alone, no network
    try:
        return AutoTokenizer.from_pretrained(str(DEMO_MAIN))
    finally:
        mp.undo()


def test_every_demo_folder_ships_the_same_files() -> None:
    for folder in (DEMO_DRAFT, DEMO_MTP):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (folder / name).read_bytes() == (DEMO_MAIN / name).read_bytes(), folder
    assert isinstance(load_tokenizer(DEMO_MAIN), ByteTokenizer)
    assert load_tokenizer(DEMO_DRAFT).folder == DEMO_DRAFT


def test_generator_reproduces_the_committed_files(tmp_path: Path) -> None:
    script = REPO / "scripts" / "make_demo_tokenizer.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (DEMO_MAIN / name).read_bytes(), name


def test_transformers_encodes_like_the_engine(hf_tokenizer: object) -> None:
    engine = ByteTokenizer(DEMO_MAIN)
    hf = hf_tokenizer
    assert len(hf) == len(engine) == 272  # type: ignore[arg-type]
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (  # type: ignore[attr-defined]
        engine.bos_token_id,
        engine.eos_token_id,
        engine.pad_token_id,
    )
    for text in TEXTS:
        ids = engine.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert hf.encode(text) == ids, text  # type: ignore[attr-defined]
        assert hf(text)["input_ids"] == ids, text  # type: ignore[operator]
        assert hf.decode(ids, skip_special_tokens=True) == text  # type: ignore[attr-defined]


def test_tokenizers_library_encodes_like_the_engine() -> None:
    engine = ByteTokenizer()
    raw = tokenizers.Tokenizer.from_file(str(DEMO_MAIN / "tokenizer.json"))
    assert raw.get_vocab_size() == len(engine)
    for text in TEXTS:
        if "<" not in text:  # without the flag the library matches special names in text
            assert raw.encode(text).ids == engine.encode(text), text
    raw.encode_special_tokens = True  # what split_special_tokens says to transformers
    for text in TEXTS:
        assert raw.encode(text).ids == engine.encode(text), text


def test_decoding_agrees_on_random_ids(hf_tokenizer: object) -> None:
    """Cut UTF-8 sequences (U+FFFD), special ids between bytes, every id of the vocab."""
    engine = ByteTokenizer()
    raw = tokenizers.Tokenizer.from_file(str(DEMO_MAIN / "tokenizer.json"))
    rng = random.Random(26)
    cases = [[rng.randrange(272) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    cases += [[0xC3], [0xE6, 0x97], [0xC3, 256, 0xA9], list(range(272))]
    for ids in cases:
        for skip in (True, False):
            want = engine.decode(ids, skip_special_tokens=skip)
            assert hf_tokenizer.decode(ids, skip_special_tokens=skip) == want, ids  # type: ignore[attr-defined]
            assert raw.decode(ids, skip_special_tokens=skip) == want, ids
    assert engine.decode([256, 104, 257], skip_special_tokens=False) == "<bos>h<eos>"


def test_chat_template_agrees_with_the_server(hf_tokenizer: object) -> None:
    engine = ByteTokenizer()
    for end in range(1, len(MESSAGES) + 1):
        messages = MESSAGES[:end]
        for prompt in (True, False):
            text = hf_tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                messages, add_generation_prompt=prompt, tokenize=False
            )
            assert engine.apply_chat_template(messages, prompt, tokenize=False) == text
            assert engine.apply_chat_template(messages, prompt) == engine.encode(text)
    assert text.startswith("<|system|>\nYou are terse. ✓\n<|system|>\nAnswer in Python.\n")
    served = render_demo_chat(MESSAGES)  # the server's own rendering of the demo chat
    assert engine.apply_chat_template(MESSAGES, tokenize=False) == served


def test_bytes_checkpoint_without_files_uses_the_packaged_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hybridkv_tokenizer": "bytes"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.folder == DEMO_MAIN


def test_files_that_are_not_the_byte_layout_are_refused(tmp_path: Path) -> None:
    shutil.copy(DEMO_MAIN / "tokenizer_config.json", tmp_path)
    data = json.loads((DEMO_MAIN / "tokenizer.json").read_text())
    data["model"]["vocab"]["a"] = 98  # byte 'a' under another id
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match=r"tokenizer.json: not the byte layout.*1 bytes"):
        ByteTokenizer(tmp_path)
    data = json.loads((DEMO_MAIN / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((DEMO_MAIN / "tokenizer_config.json").read_text())
    config["eos_token"] = "</s>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"eos_token '</s>' is not one of the 16 special"):
        ByteTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(EngineError, match=r"cannot read the byte tokenizer's tokenizer\.json"):
        ByteTokenizer(tmp_path)

"""Tokenizers for the engine: a byte-level one for the built-in demo models.

The demo checkpoints (``hybridkv/engine/models/demo_models``) are trained on raw UTF-8 bytes:
ids 0..255 are the bytes themselves and the special ids sit above them::

    id     0 ... 255 | 256    257    258    259 ............... 271
    token  byte 0..255 | <bos>  <eos>  <pad>  <reserved_259> .. <reserved_271>

Each demo folder ships that tokenizer as Hugging Face files (``tokenizer.json`` +
``tokenizer_config.json``, written by ``scripts/make_demo_tokenizer.py`` from the
constants below), so ``transformers.AutoTokenizer`` and ``tokenizers`` load it offline.
The engine reads the same files (`ByteTokenizer(folder)`): special names and ids, the
BOS / EOS / PAD roles and the chat template come from them, and loading checks that the
vocabulary is the byte layout above, so the engine and a Hugging Face client give the
same ids for any text ("<eos>" typed in a prompt is five bytes: ``split_special_tokens``).

A checkpoint says it uses this tokenizer with ``"hybridkv_tokenizer": "bytes"`` in its
``config.json`` (a folder without the files gets the packaged demo files); any other
checkpoint gets transformers' ``AutoTokenizer`` when it ships tokenizer files.

This module does not import torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.errors import EngineError

BYTE_TOKENIZER_TAG = "bytes"
CONFIG_KEY = "hybridkv_tokenizer"
NUM_BYTES = 256
VOCAB_SIZE = 272  # the demo embeddings' rows: 259 used ids rounded up to a multiple of 16
DEMO_TOKENIZER_DIR = Path(__file__).resolve().parent / "demo_models" / "main"

# The layout `scripts/make_demo_tokenizer.py` writes; at run time the files are read.
SPECIAL_TOKENS: dict[int, str] = {256: "<bos>", 257: "<eos>", 258: "<pad>"} | {
    i: f"<reserved_{i}>" for i in range(259, VOCAB_SIZE)
}
# One role line per message, its content, then the assistant's role line (the demo
# models were trained on code, not chats: the template exists so chat clients work).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + ('system' if message['role'] == 'developer' else message['role']) + '|>\\n' }}"
    "{{ message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _byte_symbols() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's convention): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for code points 256, 257, ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, shifted = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(NUM_BYTES + shifted)
            shifted += 1
    return symbols


BYTE_SYMBOLS = _byte_symbols()

# Files whose presence means transformers can build a tokenizer from the folder.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus the special ids of the folder's tokenizer files.

    ``ByteTokenizer()`` reads the packaged demo files; ``ByteTokenizer(folder)`` a
    folder's ``tokenizer.json`` + ``tokenizer_config.json`` (an `EngineError` names the
    file and the field when they are not the byte layout).
    """

    # The demo layout, for code that needs it before any file is read (training script).
    NUM_BYTES = NUM_BYTES
    BOS_ID = 256
    EOS_ID = 257
    PAD_ID = 258
    VOCAB_SIZE = VOCAB_SIZE

    name = BYTE_TOKENIZER_TAG

    def __init__(self, folder: str | Path | None = None) -> None:
        path = Path(folder or DEMO_TOKENIZER_DIR).resolve()
        files = _read_files(str(path), _stamp(path))
        self.folder = Path(files.folder)
        self.special_tokens: Mapping[int, str] = files.special_tokens
        self.bos_token_id = files.role_ids["bos_token"]
        self.eos_token_id = files.role_ids["eos_token"]
        self.pad_token_id = files.role_ids["pad_token"]
        self.vocab_size = NUM_BYTES + len(files.special_tokens)
        self.chat_template: str | None = files.chat_template

    def encode(
        self,
        text: str,
        add_bos: bool = False,
        add_eos: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, optionally framed by BOS / EOS.

        ``add_special_tokens`` is accepted for Hugging Face callers and adds nothing: the
        files define no post-processor, so transformers adds nothing either.
        """
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text from ids; invalid UTF-8 becomes U+FFFD, special ids are dropped.

        With ``skip_special_tokens=False`` special ids are written by name (``<bos>``,
        ``<eos>``, ...; an id outside the vocabulary as ``<unk>``).
        """
        out = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < NUM_BYTES:
                out.append(i)
            elif not skip_special_tokens:
                out.extend(self.special_name(i).encode("utf-8"))
        return out.decode("utf-8", errors="replace")

    def special_name(self, token_id: int) -> str:
        """The printable name of a non-byte id."""
        return self.special_tokens.get(token_id, "<unk>")

    def is_special(self, token_id: int) -> bool:
        return not 0 <= token_id < NUM_BYTES

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> str | list[int]:
        """The chat template of ``tokenizer_config.json`` rendered as transformers does
        (jinja2, sandboxed, ``trim_blocks`` / ``lstrip_blocks``); ids when ``tokenize``."""
        if self.chat_template is None:
            raise EngineError(
                f"{self.folder / 'tokenizer_config.json'} has no chat_template; send plain "
                "prompts, or add one with scripts/make_demo_tokenizer.py"
            )
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt
        )
        return self.encode(text) if tokenize else text

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, folder={str(self.folder)!r})"


class _Files:
    """What `ByteTokenizer` takes from a folder's tokenizer files (read once per folder)."""

    def __init__(
        self,
        folder: str,
        special_tokens: dict[int, str],
        role_ids: dict[str, int],
        chat_template: str | None,
    ) -> None:
        self.folder = folder
        self.special_tokens = special_tokens
        self.role_ids = role_ids
        self.chat_template = chat_template


def _stamp(folder: Path) -> tuple[int, ...]:
    """The files' modification times: an edited file is read again."""
    names = ("tokenizer.json", "tokenizer_config.json")
    return tuple((folder / n).stat().st_mtime_ns if (folder / n).exists() else 0 for n in names)


@functools.lru_cache(maxsize=16)
def _read_files(folder: str, stamp: tuple[int, ...]) -> _Files:
    tokenizer_file = Path(folder) / "tokenizer.json"
    config_file = Path(folder) / "tokenizer_config.json"
    tokenizer = _read_json(tokenizer_file)
    config = _read_json(config_file)

    model = tokenizer.get("model") or {}
    vocab = model.get("vocab") or {}
    wrong = [b for b in range(NUM_BYTES) if vocab.get(BYTE_SYMBOLS[b]) != b]
    if model.get("type") != "BPE" or model.get("merges") or wrong or len(vocab) != NUM_BYTES:
        raise EngineError(
            f"{tokenizer_file}: not the byte layout (a BPE model whose {NUM_BYTES} entries map "
            f"each byte's symbol to the byte's value, no merges): type {model.get('type')!r}, "
            f"{len(vocab)} entries, {len(model.get('merges') or [])} merges, "
            f"{len(wrong)} bytes with another id; regenerate it with "
            "scripts/make_demo_tokenizer.py"
        )
    special_tokens: dict[int, str] = {}
    for entry in tokenizer.get("added_tokens") or []:
        token_id, content = int(entry["id"]), str(entry["content"])
        if token_id < NUM_BYTES or not entry.get("special", False):
            raise EngineError(
                f"{tokenizer_file}: added token {content!r} has id {token_id} and special="
                f"{entry.get('special')}; the byte layout keeps ids 0..{NUM_BYTES - 1} for "
                "bytes and adds only special tokens above them"
            )
        special_tokens[token_id] = content
    ids_by_name = {name: i for i, name in special_tokens.items()}
    role_ids = {}
    for role in ("bos_token", "eos_token", "pad_token"):
        value = config.get(role)
        name = value.get("content") if isinstance(value, dict) else value
        if name not in ids_by_name:
            raise EngineError(
                f"{config_file}: {role} {name!r} is not one of the {len(ids_by_name)} special "
                f"tokens of {tokenizer_file} ({', '.join(sorted(ids_by_name)[:4])}, ...)"
            )
        role_ids[role] = ids_by_name[name]
    template = config.get("chat_template")
    return _Files(folder, special_tokens, role_ids, template if isinstance(template, str) else None)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise EngineError(
            f"cannot read the byte tokenizer's {path.name} in {path.parent}: {err}; "
            "scripts/make_demo_tokenizer.py writes it"
        ) from None
    if not isinstance(data, dict):
        raise EngineError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def uses_byte_tokenizer(config: dict[str, Any]) -> bool:
    """Whether a checkpoint config asks for the byte tokenizer."""
    return config.get(CONFIG_KEY) == BYTE_TOKENIZER_TAG


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer for a checkpoint folder, or None when it has none.

    ``ByteTokenizer`` when ``config.json`` says ``"hybridkv_tokenizer": "bytes"`` (from
    the folder's tokenizer files, else the packaged demo files); otherwise
    ``transformers.AutoTokenizer`` when the folder holds tokenizer files and
    transformers can read them; otherwise None.
    """
    folder = Path(model_dir)
    config_file = folder / "config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError):
            config = {}
        if isinstance(config, dict) and uses_byte_tokenizer(config):
            own = (folder / "tokenizer.json").is_file()
            return ByteTokenizer(folder if own else None)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError):
        return None

"""Tokenizers for the engine: a byte-level one for the built-in demo models.

The demo checkpoints (``hybridkv/engine/demo_models``) are trained on raw UTF-8 bytes:
ids 0..255 are the bytes themselves and a few special ids sit above them. A checkpoint
says it uses this tokenizer with ``"hybridkv_tokenizer": "bytes"`` in its ``config.json``;
any other checkpoint gets transformers' ``AutoTokenizer`` when it ships tokenizer files.

This module does not import torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BYTE_TOKENIZER_TAG = "bytes"
CONFIG_KEY = "hybridkv_tokenizer"

# Files whose presence means transformers can build a tokenizer from the folder.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus BOS / EOS / PAD above the 256 byte ids."""

    NUM_BYTES = 256
    BOS_ID = 256
    EOS_ID = 257
    PAD_ID = 258
    VOCAB_SIZE = 272  # 259 used ids, rounded up to a multiple of 16

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID
    vocab_size = VOCAB_SIZE
    name = BYTE_TOKENIZER_TAG

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, optionally framed by BOS / EOS."""
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.BOS_ID)
        if add_eos:
            ids.append(self.EOS_ID)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text from ids; invalid UTF-8 becomes U+FFFD, special ids are dropped.

        With ``skip_special_tokens=False`` the special ids are written as ``<bos>``,
        ``<eos>``, ``<pad>`` (any other id above 255 as ``<unk>``).
        """
        out = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < self.NUM_BYTES:
                out.append(i)
            elif not skip_special_tokens:
                out.extend(self.special_name(i).encode("ascii"))
        return out.decode("utf-8", errors="replace")

    def special_name(self, token_id: int) -> str:
        """The printable name of a non-byte id."""
        return {self.BOS_ID: "<bos>", self.EOS_ID: "<eos>", self.PAD_ID: "<pad>"}.get(
            token_id, "<unk>"
        )

    def is_special(self, token_id: int) -> bool:
        return not 0 <= token_id < self.NUM_BYTES

    def __len__(self) -> int:
        return self.VOCAB_SIZE

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.VOCAB_SIZE})"


def uses_byte_tokenizer(config: dict[str, Any]) -> bool:
    """Whether a checkpoint config asks for the byte tokenizer."""
    return config.get(CONFIG_KEY) == BYTE_TOKENIZER_TAG


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer for a checkpoint folder, or None when it has none.

    ``ByteTokenizer`` when ``config.json`` says ``"hybridkv_tokenizer": "bytes"``;
    otherwise ``transformers.AutoTokenizer`` when the folder holds tokenizer files and
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
            return ByteTokenizer()
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

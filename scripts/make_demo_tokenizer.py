"""Write the demo models' tokenizer files (``tokenizer.json`` + ``tokenizer_config.json``).

Usage: ``python scripts/make_demo_tokenizer.py [--out DIR ...]``; by default it writes into
``src/hybridkv/engine/models/demo_models/{main,draft,mtp}``. The output is deterministic; rerun it
after changing the layout below and commit the files.

The demo checkpoints were trained on raw UTF-8 bytes (``scripts/train_demo_models.py``):
ids 0..255 are the bytes themselves, 256 / 257 / 258 are BOS / EOS / PAD, and 259..271 are
unused (the embedding has 272 rows). The files describe exactly that with the ``tokenizers``
library, so that ``transformers.AutoTokenizer``, ``tokenizers.Tokenizer`` and the engine's
own ``hybridkv.engine.models.tokenizer.ByteTokenizer`` (which reads these files) agree id for id:

- model: BPE over the 256 byte symbols of the byte-level alphabet (GPT-2's printable
  stand-ins for bytes), no merges, so every byte is one token whose id is its value;
- pre-tokenizer / decoder: byte-level without a prefix space and without the word regex,
  so text is split into its UTF-8 bytes and nothing else;
- special tokens ``<bos>``, ``<eos>``, ``<pad>`` and ``<reserved_259>`` .. ``<reserved_271>``,
  never added to an encoding (no post-processor: the engine adds none either);
- ``split_special_tokens: true`` in ``tokenizer_config.json``: transformers encodes the
  text "<eos>" as its five bytes, as the engine does. (``tokenizers.Tokenizer`` reads no
  such flag from the file: set ``tokenizer.encode_special_tokens = True`` for the same.)
- the chat template of ``hybridkv serve demo``: a role line per message, the content, and
  the assistant's role line as the generation prompt (see ``CHAT_TEMPLATE``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hybridkv.engine.models.tokenizer import (  # noqa: E402
    BYTE_SYMBOLS,
    CHAT_TEMPLATE,
    NUM_BYTES,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
)

DEFAULT_OUT = [
    REPO / "src" / "hybridkv" / "engine" / "models" / "demo_models" / n
    for n in ("main", "draft", "mtp")
]


def build_tokenizer() -> object:
    """The ``tokenizers.Tokenizer`` of the demo models."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {BYTE_SYMBOLS[b]: b for b in range(NUM_BYTES)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [SPECIAL_TOKENS[i] for i in range(NUM_BYTES, VOCAB_SIZE)]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for token_id in range(NUM_BYTES, VOCAB_SIZE):
        if tokenizer.token_to_id(SPECIAL_TOKENS[token_id]) != token_id:
            raise SystemExit(
                f"special token {SPECIAL_TOKENS[token_id]!r} did not get id {token_id}"
            )
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[256],
        "eos_token": SPECIAL_TOKENS[257],
        "pad_token": SPECIAL_TOKENS[258],
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, nargs="+", default=DEFAULT_OUT)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    for folder in args.out:
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(folder / "tokenizer.json"), pretty=True)  # type: ignore[attr-defined]
        text = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
        (folder / "tokenizer_config.json").write_text(text)
        print(f"wrote {folder}/tokenizer.json and tokenizer_config.json")


if __name__ == "__main__":
    main()

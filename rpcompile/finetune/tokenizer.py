"""Tokenizers: a byte-level one written here (no download), or a checkpoint's own via AutoTokenizer.

Both are used through the same four things: ``encode(text) -> list[int]``, ``bos_token_id``
(may be None), ``eos_token_id``, ``pad_token_id`` and ``vocab_size``, plus ``save_pretrained``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import UsageError

BYTE_TOKENIZER_FILE = "rpcompile_tokenizer.json"


class ByteTokenizer:
    """Bytes 0..255 of the UTF-8 text are the ids 0..255; then BOS=256, EOS=257, PAD=258."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    name = "byte-level (256 bytes + BOS/EOS/PAD)"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory) -> None:
        spec = {"type": "byte", "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, "vocab_size": self.vocab_size}
        Path(directory, BYTE_TOKENIZER_FILE).write_text(json.dumps(spec, indent=2) + "\n")


class HFTokenizer:
    """A transformers tokenizer seen through the same small interface."""

    def __init__(self, tok):
        self.tok = tok
        self.bos_token_id = tok.bos_token_id
        self.eos_token_id = tok.eos_token_id
        pad = tok.pad_token_id
        self.pad_token_id = pad if pad is not None else (tok.eos_token_id if tok.eos_token_id is not None else 0)
        self.vocab_size = len(tok)
        self.name = f"{type(tok).__name__} ({len(tok)} tokens)"

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def save_pretrained(self, directory) -> None:
        self.tok.save_pretrained(str(directory))


def load_tokenizer(directory) -> ByteTokenizer | HFTokenizer:
    """The tokenizer stored in a model or checkpoint directory (rpcompile's byte tokenizer or a
    transformers one). A directory without one, or with one that does not load, is a UsageError:
    falling back to the byte tokenizer trained a pretrained model on ids that mean other tokens
    to it, without a word."""
    directory = Path(directory)
    if (directory / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer()
    hf_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / f).is_file() for f in hf_files):
        raise UsageError(f"{directory}: no tokenizer there (none of {', '.join(hf_files)}); save the model's "
                         f"tokenizer beside it (tokenizer.save_pretrained(...)): the model trains on its own tokens")
    try:
        from transformers import AutoTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(os.fspath(directory), local_files_only=True))
    except Exception as e:
        raise UsageError(f"{directory}: its tokenizer does not load ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})") from None

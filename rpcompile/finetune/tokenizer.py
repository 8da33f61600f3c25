"""Tokenizers: a byte-level one written here (no download), or a checkpoint's own via AutoTokenizer.

Both are used through the same four things: ``encode(text) -> list[int]``, ``bos_token_id``
(may be None), ``eos_token_id``, ``pad_token_id`` and ``vocab_size``, plus ``save_pretrained``.

The byte tokenizer saves itself twice: as a transformers tokenizer (``tokenizer.json`` +
``tokenizer_config.json``: a ``tokenizers`` byte-level BPE without merges whose ids are the
byte tokenizer's, so ``AutoTokenizer.from_pretrained(checkpoint)`` encodes and decodes as the
run trained), and as the marker ``rpcompile_tokenizer.json`` by which a resumed run, or a run
started from the checkpoint with ``--model``, knows it and uses ``ByteTokenizer`` itself.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import UsageError

BYTE_TOKENIZER_FILE = "rpcompile_tokenizer.json"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"   # the special tokens' names in the transformers tokenizer


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
        """``tokenizer.json`` and ``tokenizer_config.json`` (what ``AutoTokenizer`` loads) and the
        marker ``rpcompile_tokenizer.json`` (module docstring)."""
        self.to_transformers().save_pretrained(str(directory))
        spec = {"type": "byte", "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, "vocab_size": self.vocab_size,
                "note": "rpcompile-finetune's byte tokenizer; transformers loads the same one from "
                        "tokenizer.json (AutoTokenizer.from_pretrained of this directory)"}
        Path(directory, BYTE_TOKENIZER_FILE).write_text(json.dumps(spec, indent=2) + "\n")

    def to_transformers(self):
        """This tokenizer as a ``PreTrainedTokenizerFast``: byte b is id b (GPT-2's byte-level
        alphabet, no merges), then BOS, EOS, PAD; ``tok(text)`` starts with BOS as the training
        rows do (``add_special_tokens=False``: the bytes alone), and a ``<|eos|>`` in the text is
        bytes, as here (``split_special_tokens``)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        alphabet = _bytes_to_unicode()
        tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([BOS, EOS, PAD])
        assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [self.bos_token_id, self.eos_token_id,
                                                                 self.pad_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, self.bos_token_id)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                       split_special_tokens=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ``tokenizers``' ByteLevel
    pre-tokenizer maps bytes to)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


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

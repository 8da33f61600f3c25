"""Training data: read a text or JSONL file, tokenize it into fixed-length rows, and walk them.

A plain text file is one document. A JSONL file holds one object per line: ``{"text": ...}``
(a document) or ``{"prompt": ..., "completion": ...}`` (loss on the completion only).
Documents are packed: ``BOS doc EOS BOS doc EOS ...`` cut into rows of ``seq_len`` tokens.
Prompt/completion pairs get a row each, padded with PAD, their prompt and padding masked
out of the labels with -100. ``attention_mask`` marks the real tokens of each row (1) and
its padding (0); the command passes it to the model whenever the data has padding.

The order of rows is a fresh permutation per epoch, drawn from ``seed`` and the epoch
number only, so the whole data position is one integer (rows consumed so far): a resumed
run continues with exactly the rows the interrupted one would have used.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .errors import UsageError
from .report import plural

IGNORE = -100
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
FINGERPRINT_SPAN = 1 << 20   # a data file's fingerprint hashes its first and last MiB and its size


def default_corpus() -> Path:
    """The corpus shipped in the package (the first chapters of Alice in Wonderland)."""
    return Path(str(resources.files(__package__).joinpath("data", "alice.txt")))


@dataclass
class Documents:
    source: str
    texts: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    file_fingerprint: str | None = None   # of the file read (file_fingerprint()); None: the built-in corpus


def _fingerprint(size: int, head: bytes, tail: bytes) -> str:
    digest = hashlib.sha256(b"%d\0" % size + head + b"\0" + tail).hexdigest()
    return f"{size}:{digest}"


def file_fingerprint(path) -> str:
    """``SIZE:SHA256`` of a data file's size, first MiB and last MiB: cheap for a file of any size,
    independent of its mtime (a copy or a touch is the same data). A resumed run compares it
    before reading the file; the tokens' own fingerprint (``TokenData.fingerprint``) then
    catches a change in the middle of a large file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(FINGERPRINT_SPAN)
        tail = b""
        if size > FINGERPRINT_SPAN:
            f.seek(max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN))
            tail = f.read()
    return _fingerprint(size, head, tail)


def bytes_fingerprint(raw: bytes) -> str:
    """``file_fingerprint`` of a file holding ``raw``."""
    span = FINGERPRINT_SPAN
    return _fingerprint(len(raw), raw[:span], raw[max(span, len(raw) - span):] if len(raw) > span else b"")


def read_documents(path=None) -> Documents:
    """Parse ``path`` (None: the built-in corpus); every problem is a UsageError naming the
    file (and line)."""
    if path is None:
        return Documents(source="built-in corpus (alice.txt)", texts=[default_corpus().read_text("utf-8")])
    path = Path(path)
    if not path.exists():
        raise UsageError(f"--data {path}: no such file")
    if not path.is_file():
        raise UsageError(f"--data {path}: not a regular file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"--data {path}: cannot read it ({e.strerror or e})") from None
    try:
        content = raw.decode("utf-8-sig")   # (a byte-order mark is not text)
    except UnicodeDecodeError as e:
        raise UsageError(f"--data {path}: not UTF-8 text (bad byte at offset {e.start})") from None
    docs = Documents(source=str(path), file_fingerprint=bytes_fingerprint(raw))
    if path.suffix.lower() not in JSONL_SUFFIXES:
        if not content.strip():
            raise UsageError(f"--data {path}: the file is empty")
        docs.texts.append(content)
        return docs
    for lineno, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        where = f"--data {path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                             f"JSONL needs one JSON object per line") from None
        if not isinstance(record, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if "text" in record:
            if not isinstance(record["text"], str):
                raise UsageError(f'{where}: "text" must be a string')
            docs.texts.append(record["text"])
        elif "prompt" in record and "completion" in record:
            if not (isinstance(record["prompt"], str) and isinstance(record["completion"], str)):
                raise UsageError(f'{where}: "prompt" and "completion" must be strings')
            docs.pairs.append((record["prompt"], record["completion"]))
        else:
            raise UsageError(f'{where}: needs a "text" field, or "prompt" and "completion" fields')
    if not docs.texts and not docs.pairs:
        raise UsageError(f"--data {path}: no examples in the file")
    return docs


@dataclass
class TokenData:
    input_ids: torch.Tensor   # [rows, seq_len], int64
    labels: torch.Tensor      # [rows, seq_len], int64, IGNORE where no loss
    description: str
    fingerprint: str          # sha256 of ids and labels: a resumed run checks it sees the same data
    attention_mask: torch.Tensor | None = None   # [rows, seq_len], int64: 1 real token, 0 padding

    def __post_init__(self):
        if self.attention_mask is None:
            self.attention_mask = torch.ones_like(self.input_ids)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def has_padding(self) -> bool:
        return bool((self.attention_mask == 0).any())

    def batch(self, rows: torch.Tensor) -> dict:
        """The model's keyword arguments for these rows: input_ids and labels, and the
        attention_mask when the data has padding anywhere (then every batch carries one, so
        the model is captured once)."""
        out = {"input_ids": self.input_ids[rows], "labels": self.labels[rows]}
        if self.has_padding:
            out["attention_mask"] = self.attention_mask[rows]
        return out


def tokenize(docs: Documents, tokenizer, seq_len: int) -> TokenData:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = tokenizer.pad_token_id
    rows_ids: list[list[int]] = []
    rows_labels: list[list[int]] = []
    rows_real: list[int] = []    # tokens before the padding, per row

    if docs.texts:
        stream: list[int] = []
        for text in docs.texts:
            stream += bos + tokenizer.encode(text) + eos
        if len(stream) < seq_len:  # too short for one row: one padded row
            rows_ids.append(stream + [pad] * (seq_len - len(stream)))
            rows_labels.append(stream + [IGNORE] * (seq_len - len(stream)))
            rows_real.append(len(stream))
        for start in range(0, len(stream) - seq_len + 1, seq_len):
            rows_ids.append(stream[start:start + seq_len])
            rows_labels.append(rows_ids[-1])
            rows_real.append(seq_len)

    skipped = 0
    for prompt, completion in docs.pairs:
        p, c = bos + tokenizer.encode(prompt), tokenizer.encode(completion) + eos
        ids, labels = (p + c)[:seq_len], ([IGNORE] * len(p) + c)[:seq_len]
        if all(x == IGNORE for x in labels[1:]):  # the prompt fills the row: nothing to learn
            skipped += 1
            continue
        rows_ids.append(ids + [pad] * (seq_len - len(ids)))
        rows_labels.append(labels + [IGNORE] * (seq_len - len(labels)))
        rows_real.append(len(ids))
    if not rows_ids:
        raise UsageError(f"--data {docs.source}: every prompt is {seq_len} tokens or longer, "
                         f"so no completion token fits; raise --seq-len")

    input_ids = torch.tensor(rows_ids, dtype=torch.long)
    labels = torch.tensor(rows_labels, dtype=torch.long)
    attention_mask = (torch.arange(seq_len)[None, :] < torch.tensor(rows_real)[:, None]).long()
    if int(input_ids.max()) >= tokenizer.vocab_size or int(input_ids.min()) < 0:
        raise UsageError(f"--data {docs.source}: the tokenizer produced ids outside its vocabulary")
    digest = hashlib.sha256(input_ids.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()
    what = []
    if docs.texts:
        what.append(plural(len(docs.texts), "document"))
    if docs.pairs:
        what.append(plural(len(docs.pairs) - skipped, "prompt/completion pair")
                    + (f" ({skipped} skipped: prompt longer than --seq-len)" if skipped else ""))
    padded = int((attention_mask == 0).any(1).sum())
    description = (f"{docs.source}: {', '.join(what)} -> {plural(len(rows_ids), 'row')} of {seq_len} tokens "
                   f"({plural(int((labels[:, 1:] != IGNORE).sum()), 'predicted token')}"
                   + (f"; {plural(padded, 'padded row')}, passed with an attention_mask" if padded else "")
                   + ")")
    # the fingerprint covers ids and labels only (as before the mask existed), so checkpoints
    # saved then still resume; the mask follows from the same data and tokenizer
    return TokenData(input_ids, labels, description, digest, attention_mask)


class Sampler:
    """Batches of rows in a per-epoch shuffled order; its whole state is ``cursor``."""

    def __init__(self, num_rows: int, batch_size: int, seed: int, cursor: int = 0):
        self.num_rows, self.batch_size, self.seed, self.cursor = num_rows, batch_size, seed, cursor
        self._epoch, self._order = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_rows, generator=g)
        return self._order

    def next_indices(self) -> torch.Tensor:
        out = []
        for _ in range(self.batch_size):
            epoch, offset = divmod(self.cursor, self.num_rows)
            out.append(int(self._permutation(epoch)[offset]))
            self.cursor += 1
        return torch.tensor(out, dtype=torch.long)

    @property
    def epoch(self) -> float:
        return self.cursor / self.num_rows

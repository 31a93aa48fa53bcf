"""Text corpora as packed token sequences for next-token prediction.

A corpus (one file, or every .txt/.md file under a folder, in sorted order)
becomes one token stream, each document framed as its tokenizer frames it
(BOS first when the tokenizer adds one) and closed with EOS. The stream is split
into train | val at the token level (val is the tail) and each part is cut
into windows of seq_len + 1 tokens that overlap by one, so every token except
the first is a target exactly once: inputs = window[:-1], targets = window[1:].

Nothing is cached on disk; in particular nothing is written into the user's
corpus folder. Tokenizing is cheap next to training at the sizes this is for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Protocol

import torch

from .errors import DataError
from .hf_tokenizer import load_tokenizer

TEXT_SUFFIXES = (".txt", ".md")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def document(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Token i < 256 is byte i of the UTF-8 encoding; then BOS, EOS, PAD.

    Needs no vocabulary file and round-trips any text exactly. decode drops
    special tokens and replaces invalid byte sequences (which a model can
    produce) with U+FFFD instead of failing.
    """

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def document(self, text: str) -> list[int]:
        """One document of a corpus: its bytes, then EOS."""
        return self.encode(text, eos=True)

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"ByteTokenizer.decode got ids {bad[:5]} outside [0, {self.vocab_size})")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


def get_tokenizer(spec: str | Path, eos_token: str | None = None) -> Tokenizer:
    """'byte' -> ByteTokenizer(); anything else is a tokenizer.json or a folder holding one, for load_tokenizer."""
    if str(spec) == "byte":
        if eos_token is not None:
            raise DataError(f"data.eos_token={eos_token!r} needs a tokenizer file: the byte tokenizer's EOS is fixed; set data.eos_token=null")
        return ByteTokenizer()
    return load_tokenizer(spec, eos_token)


def corpus_files(path: str | Path) -> list[Path]:
    """`path` itself if it is a file, else the .txt/.md files under it (recursively, hidden ones skipped), sorted."""
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"text corpus {root} does not exist: set data.path to a text file or a folder of .txt/.md files")
    files = [
        f
        for f in root.rglob("*")
        if f.suffix.lower() in TEXT_SUFFIXES and f.is_file() and not any(p.startswith(".") for p in f.relative_to(root).parts)
    ]
    if not files:
        raise DataError(f"no .txt or .md files under {root}: set data.path to a text file or a folder of them")
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


@dataclass
class TextCorpus:
    train: tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64 (n, seq_len), views of one tensor
    val: tuple[torch.Tensor, torch.Tensor]  # same; (0, seq_len) when val_fraction == 0
    vocab_size: int
    num_tokens: int  # train + val, including the EOS tokens
    files: list[Path] = field(default_factory=list)


def pack(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a 1-D token stream into (inputs, targets) windows; the tail shorter than a window is dropped."""
    if len(stream) < seq_len + 1:
        empty = torch.empty(0, seq_len, dtype=torch.int64)
        return empty, empty
    windows = stream.unfold(0, seq_len + 1, seq_len)  # a view: no copy of the stream
    return windows[:, :-1], windows[:, 1:]


def load_text_corpus(path: str | Path, tokenizer: Tokenizer, seq_len: int, val_fraction: float = 0.1) -> TextCorpus:
    """Tokenize a file or folder of text into packed train/val sequences ready for BatchLoader."""
    if seq_len < 1:
        raise DataError(f"data.seq_len={seq_len} must be >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    files = corpus_files(path)
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{f} is not UTF-8 text ({err.reason} at byte {err.start}): convert it or remove it from {path}") from err
        except OSError as err:
            raise DataError(f"could not read {f} ({type(err).__name__}: {err.strerror or err})") from err
        if text:
            docs.append(torch.tensor(tokenizer.document(text), dtype=torch.int64))
    if not docs:
        raise DataError(f"text corpus {path} is empty ({len(files)} file(s), 0 characters): add text or point data.path elsewhere")
    stream = torch.cat(docs)
    total = len(stream)
    n_val = int(total * val_fraction)
    need = seq_len + 1
    if total - n_val < need:
        raise DataError(
            f"text corpus {path} has {total - n_val} training tokens ({total} in all, val_fraction={val_fraction}), "
            f"fewer than one sequence of seq_len+1={need}: lower data.seq_len or add text"
        )
    if 0 < n_val < need:
        raise DataError(
            f"validation split of {path} has {n_val} tokens ({total} in all, val_fraction={val_fraction}), "
            f"fewer than one sequence of seq_len+1={need}: raise data.val_fraction, lower data.seq_len, or set data.val_fraction=0"
        )
    return TextCorpus(
        train=pack(stream[: total - n_val], seq_len),
        val=pack(stream[total - n_val :], seq_len),
        vocab_size=tokenizer.vocab_size,
        num_tokens=total,
        files=files,
    )

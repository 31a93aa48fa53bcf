"""Text corpora as packed token sequences for next-token prediction.

A corpus (one file, or every .txt/.md file under a folder, or every file matching data.glob, in
sorted order) becomes one token stream, each document framed as its tokenizer frames it (BOS first
when the tokenizer adds one) and closed with EOS, tokenized once into a memory-mapped cache
(token_cache.py) that later starts reuse. The stream is split into train | val at the token level
(val is the tail) and each part is cut into windows of seq_len + 1 tokens that overlap by one
(windows.py); documents sharing a window keep apart through segment ids.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Protocol

from .errors import DataError
from .token_cache import TokenStream, load_or_build
from .windows import TokenWindows
from .hf_tokenizer import load_tokenizer

TEXT_SUFFIXES = (".txt", ".md")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def document(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def token_id(self, token: str) -> int | None: ...


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

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """ids and, per id, the (start, end) characters of `text` it came from."""
        offsets = [(i, i + 1) for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]
        return self.encode(text), offsets

    def document(self, text: str) -> list[int]:
        """One document of a corpus: its bytes, then EOS."""
        return self.encode(text, eos=True)

    def token_id(self, token: str) -> int | None:
        return None  # no token spells more than one byte

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


def corpus_files(path: str | Path, glob: Optional[str] = None) -> list[Path]:
    """`path` itself if it is a file, else the .txt/.md files under it (or those matching `glob`),
    recursively, hidden ones skipped, sorted."""
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"text corpus {root} does not exist: set data.path to a text file or a folder of .txt/.md files")
    found = root.glob(glob) if glob else (f for f in root.rglob("*") if f.suffix.lower() in TEXT_SUFFIXES)
    files = [f for f in found if f.is_file() and not any(p.startswith(".") for p in f.relative_to(root).parts)]
    if not files:
        what = f"files matching data.glob={glob}" if glob else ".txt or .md files"
        raise DataError(f"no {what} under {root}: set data.path (and data.glob) to where the text is")
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


@dataclass
class TextCorpus:
    train: TokenWindows
    val: Optional[TokenWindows]  # None when val_fraction == 0
    vocab_size: int
    num_tokens: int  # train + val, including the EOS tokens
    files: list[Path] = field(default_factory=list)
    cache: Optional[TokenStream] = None


def tokenizer_id(tokenizer: Tokenizer) -> str:
    """What the token cache's key needs to know about the tokenizer: its files' bytes and how it frames documents."""
    path = getattr(tokenizer, "path", None)
    h = hashlib.sha1(type(tokenizer).__name__.encode())
    for f in [Path(path), Path(path).parent / "tokenizer_config.json"] if path else []:
        h.update(f.read_bytes() if f.is_file() else b"-")
    framing = [getattr(tokenizer, k, None) for k in ("vocab_size", "eos_id", "bos_id", "add_bos")]
    return f"{h.hexdigest()}:{framing}"


def _reader(tokenizer: Tokenizer, path: str | Path):
    def encode_file(f: Path) -> Optional[list[int]]:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{f} is not UTF-8 text ({err.reason} at byte {err.start}): convert it or remove it from {path}") from err
        except OSError as err:
            raise DataError(f"could not read {f} ({type(err).__name__}: {err.strerror or err})") from err
        return tokenizer.document(text) if text else None

    return encode_file


def load_text_corpus(
    path: str | Path, tokenizer: Tokenizer, seq_len: int, val_fraction: float = 0.1,
    glob: Optional[str] = None, cache_dir: Optional[str | Path] = None,
) -> TextCorpus:
    """Tokenize (or read the cache of) a file or folder of text into train/val windows for WindowLoader."""
    if seq_len < 1:
        raise DataError(f"data.seq_len={seq_len} must be >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    files = corpus_files(path, glob)
    root = Path(path).expanduser()
    stream = load_or_build(files, root, tokenizer_id(tokenizer), tokenizer.vocab_size, _reader(tokenizer, path), cache_dir)
    total = len(stream.tokens)
    if total == 0:
        raise DataError(f"text corpus {path} is empty ({len(files)} file(s), 0 characters): add text or point data.path elsewhere")
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
    split = total - n_val
    return TextCorpus(
        train=TokenWindows(stream.tokens, stream.doc_starts, 0, split, seq_len),
        val=TokenWindows(stream.tokens, stream.doc_starts, split, total, seq_len) if n_val else None,
        vocab_size=tokenizer.vocab_size,
        num_tokens=total,
        files=files,
        cache=stream,
    )

"""Text corpora as packed token sequences for next-token prediction.

A corpus (one file, or every .txt/.md file under a folder, or every file matching data.glob, in
sorted order) becomes one token stream with EOS after each document, tokenized once into a
memory-mapped cache (token_cache.py) that later starts reuse. The stream is split into train | val
at the token level (val is the tail) and each part is cut into windows of seq_len + 1 tokens that
overlap by one (windows.py); documents sharing a window keep apart through segment ids.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Protocol

from .errors import DataError
from .token_cache import TokenStream, load_or_build
from .windows import TokenWindows

TEXT_SUFFIXES = (".txt", ".md")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

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


EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[SEP]")


class HFTokenizer:
    """A `tokenizers` tokenizer.json behind the ByteTokenizer interface."""

    def __init__(self, tokenizer, eos_id: int, path: Path) -> None:
        self.tokenizer, self.eos_id, self.path = tokenizer, eos_id, path
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """ids and, per id, the (start, end) characters of `text` it came from."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(path: str | Path, eos_token: str | None = None) -> HFTokenizer:
    """Load a Hugging Face `tokenizers` tokenizer.json (needs `pip install tokenizers`).

    The end-of-document token is `eos_token` or the first of EOS_CANDIDATES in the vocabulary.
    """
    path = Path(path).expanduser()
    try:
        from tokenizers import Tokenizer as _HF
    except ImportError as err:
        raise DataError(f"loading tokenizer {path} needs the 'tokenizers' package: pip install tokenizers") from err
    if not path.is_file():
        raise DataError(f"tokenizer file {path} not found: set data.tokenizer to a tokenizer.json path or 'byte'")
    try:
        tok = _HF.from_file(str(path))
    except Exception as err:  # the Rust side raises plain Exception subclasses for malformed files
        raise DataError(f"could not read tokenizer {path} ({type(err).__name__}: {' '.join(str(err).split())})") from err
    names = [eos_token] if eos_token is not None else list(EOS_CANDIDATES)
    for name in names:
        eos_id = tok.token_to_id(name)
        if eos_id is not None:
            return HFTokenizer(tok, eos_id, path)
    raise DataError(f"tokenizer {path} has no end-of-text token among {names}: set data.eos_token to one it has")


def get_tokenizer(spec: str | Path) -> Tokenizer:
    """'byte' -> ByteTokenizer(); anything else is a tokenizer.json path for load_tokenizer."""
    if str(spec) == "byte":
        return ByteTokenizer()
    return load_tokenizer(spec)


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
    """What the token cache's key needs to know about the tokenizer: its file's bytes and the EOS id."""
    path = getattr(tokenizer, "path", None)
    digest = hashlib.sha1(Path(path).read_bytes()).hexdigest() if path else type(tokenizer).__name__
    return f"{digest}:{tokenizer.vocab_size}:{tokenizer.eos_id}"


def _reader(tokenizer: Tokenizer, path: str | Path):
    def encode_file(f: Path) -> Optional[list[int]]:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{f} is not UTF-8 text ({err.reason} at byte {err.start}): convert it or remove it from {path}") from err
        except OSError as err:
            raise DataError(f"could not read {f} ({type(err).__name__}: {err.strerror or err})") from err
        return tokenizer.encode(text) + [tokenizer.eos_id] if text else None

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

"""A Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json) behind rptrain's Tokenizer interface.

tokenizer.json is the `tokenizers` model; tokenizer_config.json, when present next to it, names the
BOS/EOS/PAD tokens, may add tokens and says whether BOS is prepended (add_bos_token). A document is
framed as transformers frames it: the post-processor's special tokens (Llama 3 and Gemma prepend BOS
there), BOS prepended when add_bos_token asks for it and the post-processor did not, then EOS closing
the document so that packed documents stay apart.

A long document is tokenized in pieces of at most CHUNK_CHARS characters: one call on a whole file
holds per-character alignments and per-token strings for all of it (a 54 MB file peaked at 11.5 GB).
The pieces end at line breaks, and a break is only used where tokenizing the text around it in one
piece and in two gives the same tokens (so the ids are those of one call; a tokenizer that prepends
to every input, such as SentencePiece's "always" metaspace, never passes and keeps one call).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from .errors import DataError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[SEP]")
CONFIG = "tokenizer_config.json"
CHUNK_CHARS = 1 << 20  # ~1 M characters a call: ~100 MB of tokenizer state instead of ~200 bytes per character of the file
_BOUNDARY_CONTEXT = 512  # characters each side of a break, tokenized both ways to check it
_BREAK = re.compile(r"\n(?=\S)")  # after a line break, before a line that starts with text


class HFTokenizer:
    def __init__(self, tokenizer, path: Path, eos_id: int, bos_id: Optional[int], pad_id: Optional[int], add_bos: bool) -> None:
        self.tokenizer, self.path = tokenizer, path
        self.eos_id, self.bos_id, self.pad_id, self.add_bos = eos_id, bos_id, pad_id, add_bos
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The text's tokens alone, no special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def document(self, text: str) -> list[int]:
        """One document of a corpus: framed by the tokenizer's special tokens, ending with EOS."""
        if len(text) > CHUNK_CHARS:  # a long file: an int64 array (a list would hold ~36 bytes a token)
            prefix, suffix = self._framing()
            ids = [np.asarray(prefix, dtype=np.int64), *(np.asarray(self.encode(p), dtype=np.int64) for p in self._pieces(text)),
                   np.asarray(suffix, dtype=np.int64)]
            if self.add_bos and self.bos_id is not None and prefix[:1] != [self.bos_id]:
                ids.insert(0, np.asarray([self.bos_id], dtype=np.int64))
            if (suffix or self.encode(text[-_BOUNDARY_CONTEXT:]))[-1:] != [self.eos_id]:
                ids.append(np.asarray([self.eos_id], dtype=np.int64))
            return np.concatenate(ids)
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids if ids[-1:] == [self.eos_id] else ids + [self.eos_id]

    def _framing(self) -> tuple[list[int], list[int]]:
        """The special tokens the post-processor puts before and after a text."""
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        framed = self.tokenizer.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i:i + len(plain)] == plain), 0)
        return framed[:at], framed[at + len(plain):]

    def _pieces(self, text: str) -> Iterable[str]:
        """`text` in pieces of about CHUNK_CHARS, cut only at breaks where the tokens do not change."""
        start = 0
        while len(text) - start > CHUNK_CHARS:
            cut = self._cut(text, start)
            if cut is None:
                break
            yield text[start:cut]
            start = cut
        yield text[start:]

    def _cut(self, text: str, start: int) -> Optional[int]:
        """A safe break in text[start + CHUNK_CHARS/2 : start + CHUNK_CHARS], the last that passes; None if none does."""
        window = text[start + CHUNK_CHARS // 2: start + CHUNK_CHARS]
        for m in reversed(list(_BREAK.finditer(window))[-8:]):  # a few tries: a tokenizer that fails one fails all
            cut = start + CHUNK_CHARS // 2 + m.end()
            left, right = text[max(start, cut - _BOUNDARY_CONTEXT):cut], text[cut:cut + _BOUNDARY_CONTEXT]
            if self.encode(left + right) == self.encode(left) + self.encode(right):
                return cut
        return None

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode(text) and, per id, the (start, end) characters of `text` it came from (chat loss masks)."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def token_id(self, token: str) -> Optional[int]:
        return self.tokenizer.token_to_id(token)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, bos_id={self.bos_id}, add_bos={self.add_bos})"


def _content(token: Any) -> Optional[str]:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"could not read {path} ({type(err).__name__}: {' '.join(str(err).split())}): fix or remove it") from err
    if not isinstance(config, dict):
        raise DataError(f"{path} is not a JSON object: fix or remove it")
    return config


def _add_missing_tokens(tok, config: dict) -> None:
    """Tokens that tokenizer_config.json adds (added_tokens_decoder) but tokenizer.json lacks, in id order."""
    from tokenizers import AddedToken

    added = config.get("added_tokens_decoder") or {}
    for _, spec in sorted(added.items(), key=lambda item: int(item[0])):
        if tok.token_to_id(spec["content"]) is not None:
            continue
        token = AddedToken(spec["content"], single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
                           rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", True), special=spec.get("special", False))
        (tok.add_special_tokens if spec.get("special") else tok.add_tokens)([token])


def load_tokenizer(path: str | Path, eos_token: Optional[str] = None) -> HFTokenizer:
    """A tokenizer.json file or a folder holding one (needs `pip install tokenizers`); tokenizer_config.json
    next to it is read when present. EOS: `eos_token` (data.eos_token), else the config's, else the first
    of EOS_CANDIDATES in the vocabulary."""
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        from tokenizers import Tokenizer as _HF
    except ImportError as err:
        raise DataError(f"loading tokenizer {file} needs the 'tokenizers' package: pip install tokenizers") from err
    if not file.is_file():
        raise DataError(f"tokenizer file {file} not found: set data.tokenizer to a tokenizer.json, a folder holding one, or 'byte'")
    try:
        tok = _HF.from_file(str(file))
    except Exception as err:  # the Rust side raises plain Exception subclasses for malformed files
        raise DataError(f"could not read tokenizer {file} ({type(err).__name__}: {' '.join(str(err).split())})") from err
    # A corpus document is packed whole: a truncation or padding setting saved in the file must not apply.
    tok.no_truncation()
    tok.no_padding()
    config = _read_config(file.parent / CONFIG)
    _add_missing_tokens(tok, config)

    def token_id(key: str) -> Optional[int]:
        name = _content(config.get(key))
        if name is None:
            return None
        found = tok.token_to_id(name)
        if found is None:
            raise DataError(f"{file.parent / CONFIG} names {key} {name!r}, which {file} does not have: fix the file or set data.eos_token")
        return found

    if eos_token is not None:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"data.eos_token={eos_token!r} is not a token of {file}: set data.eos_token to one it has")
    else:
        eos_id = token_id("eos_token")
        eos_id = eos_id if eos_id is not None else next((i for name in EOS_CANDIDATES if (i := tok.token_to_id(name)) is not None), None)
        if eos_id is None:
            raise DataError(f"tokenizer {file} has no end-of-text token among {list(EOS_CANDIDATES)}: set data.eos_token to one it has")
    return HFTokenizer(tok, file, eos_id, token_id("bos_token"), token_id("pad_token"), bool(config.get("add_bos_token", False)))

"""Tokenize a corpus once: a memory-mapped token file reused by every later start.

The cache is keyed by a fingerprint of the inputs: every file's relative path, size, modification
time and a hash of its first and last 64 KiB, plus the tokenizer (its file's bytes) and the EOS id.
Any change gives a new key, so a stale cache is never read; old ones are left for the user to
delete. Per key, three files:
    tokens-KEY.bin   the token stream, EOS after each document, uint16 (vocabularies up to 65,536)
                     or uint32, raw, read back with numpy.memmap (nothing is loaded into memory)
    docs-KEY.npy     int64 start offset of every document in the stream
    tokens-KEY.json  sizes and dtype, written last: a cache without it is unfinished and redone
Tokenizing streams file by file, so memory holds one file's tokens at a time.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .errors import DataError

SAMPLE = 1 << 16  # bytes hashed at each end of a file


@dataclass
class TokenStream:
    tokens: np.ndarray  # 1-D, memory-mapped
    doc_starts: np.ndarray  # int64, sorted; document d covers tokens[doc_starts[d]:doc_starts[d+1]]
    path: Path
    reused: bool  # True: read from an earlier start's cache, nothing tokenized


def _file_key(f: Path, root: Path) -> str:
    st = f.stat()
    h = hashlib.blake2b(digest_size=16)
    with open(f, "rb") as fh:
        h.update(fh.read(SAMPLE))
        if st.st_size > SAMPLE:
            fh.seek(max(SAMPLE, st.st_size - SAMPLE))
            h.update(fh.read(SAMPLE))
    name = f.relative_to(root).as_posix() if f != root else f.name
    return f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{h.hexdigest()}"


def fingerprint(files: list[Path], root: Path, tokenizer_id: str) -> str:
    h = hashlib.sha1(f"rptrain-tokens-v1\0{tokenizer_id}".encode())
    for f in files:
        h.update(b"\n" + _file_key(f, root).encode())
    return h.hexdigest()[:20]


def default_cache_dir(root: Path) -> Path:
    """DATA/.rptrain_cache for a folder (hidden: corpus listings skip it), beside a single file."""
    return (root if root.is_dir() else root.parent) / ".rptrain_cache"


def load_or_build(
    files: list[Path], root: Path, tokenizer_id: str, vocab_size: int, encode_file: Callable[[Path], Optional[list[int]]],
    cache_dir: Optional[Path] = None,
) -> TokenStream:
    """The cached stream for these files and tokenizer; built with encode_file(f) (ids incl. EOS, or None to skip) if absent."""
    folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir(root)
    key = fingerprint(files, root, tokenizer_id)
    meta_path, bin_path, docs_path = folder / f"tokens-{key}.json", folder / f"tokens-{key}.bin", folder / f"docs-{key}.npy"
    reused = meta_path.is_file()
    if not reused:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _build(files, vocab_size, encode_file, bin_path, docs_path, meta_path)
        except PermissionError as err:
            raise DataError(f"cannot write the token cache to {folder} ({err.strerror}): set data.cache_dir to a writable folder") from err
    meta = json.loads(meta_path.read_text())
    tokens = np.memmap(bin_path, dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],)) if meta["num_tokens"] else np.zeros(0, meta["dtype"])
    return TokenStream(tokens, np.load(docs_path), bin_path, reused)


def _build(files, vocab_size, encode_file, bin_path: Path, docs_path: Path, meta_path: Path) -> None:
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    starts, total = [], 0
    tmp = bin_path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for f in files:
            ids = encode_file(f)
            if ids is None or len(ids) == 0:  # a list, or an array (a long document: hf_tokenizer.py)
                continue
            starts.append(total)
            np.asarray(ids, dtype=dtype).tofile(out)
            total += len(ids)
    os.replace(tmp, bin_path)
    np.save(docs_path, np.asarray(starts, dtype=np.int64))
    meta_tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    meta_tmp.write_text(json.dumps({"dtype": np.dtype(dtype).name, "num_tokens": total, "num_docs": len(starts),
                                    "files": len(files)}))
    os.replace(meta_tmp, meta_path)

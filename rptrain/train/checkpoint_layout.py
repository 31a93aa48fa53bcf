"""How a checkpoint lies on disk: a small manifest file and the shards it names.

A shard is every byte of a run of tensors, each in its own dtype (an int8 optimizer state is written as
int8) on a 64-byte boundary, and nothing else; shards hold up to ``SHARD_BYTES`` each (a tensor larger
than that gets a shard of its own: splitting it would make loading copy it). The manifest (``MAGIC``
first and last) is a small ``torch.save`` record of the rest of the state, in which each tensor is a
reference (shard, offset, dtype, shape), and the names of its shards. Shards are named after the
manifest and the write (``step-00000040-3fa9c1d2-00002.shard`` belongs to ``step-00000040.pt``), so a
new write never touches the shards of the checkpoint it replaces, and shards no manifest names are
leftovers of a write that was killed.

Shards are written in parallel (file writes, GPU copies and hashing release the GIL) straight from
where the tensors live, a GPU tensor a chunk at a time, and each tensor's sha256 is taken from the bytes
as they are written: the checksum costs no second pass over the state. Written pages are flushed and
dropped from the page cache every ``SYNC_BYTES``, so writing a 100 GB state needs a few chunks of
memory per writer, not a second copy of it. Reading maps the files: a tensor is read when it is used.
The single-file layout of earlier versions (``MAGIC_SINGLE``: the tensors inside the manifest) reads
the same way.
"""
from __future__ import annotations

import hashlib
import io
import mmap
import os
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from rptrain.page_cache import SYNC_BYTES, drop_written

MAGIC = b"RPTCKPT3"  # a manifest's first and last 8 bytes (an older single file: MAGIC_SINGLE; a torch.save zip: "PK")
MAGIC_SINGLE = b"RPTCKPT2"
TRAILER = struct.Struct("<Q8s")  # the record's offset, the magic
TENSOR = "\0rptrain-tensor"  # a tensor's place in the state record: (TENSOR, index)
ALIGN = 64  # every tensor starts on this boundary, so a mapped shard views as any dtype
CHUNK_BYTES = 64 * 2**20  # a GPU tensor is copied to the host this much at a time
OWN_BYTES = 2**20  # a loaded tensor smaller than this gets memory of its own: some readers
# (torch.set_rng_state) take the storage's start, not a view's
SHARD_BYTES = 2 * 2**30  # a shard's tensors add up to at most this (or are one larger tensor)
WRITERS = min(8, os.cpu_count() or 1)  # shards written at once
SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<write>[0-9a-f]{8})-(?P<index>\d{5})\.shard")
DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


def tensor_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the same stored tensor (a tied weight under two names)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def unique_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` with each tensor replaced by (TENSOR, index), and the tensors by index. A tensor met
    twice (a tied weight under two names, a step count shared by a run) is stored once and loads as one."""
    tensors: list[torch.Tensor] = []
    seen: dict[tuple, int] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = tensor_key(t)
            if key not in seen or t.numel() == 0:
                seen[key] = len(tensors)
                tensors.append(t)
            return (TENSOR, seen[key])
        return rebuilt(obj, walk)

    return walk(state), tensors


def rebuilt(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to every value of its dicts, lists and tuples, keeping their types."""
    if isinstance(obj, dict):
        return type(obj)((k, fn(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    return obj


def chunks(t: torch.Tensor) -> Iterator[np.ndarray]:
    """``t``'s bytes in its standard (row-major) order as host uint8 arrays of at most CHUNK_BYTES:
    views of a host tensor's memory, or copies of a GPU tensor's."""
    t = t.detach().reshape(-1)  # a copy only for a non-contiguous tensor (one tensor, on its device)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    step = max(1, CHUNK_BYTES // t.element_size())
    for start in range(0, t.numel(), step):
        yield t[start : start + step].cpu().view(torch.uint8).numpy()  # .cpu(): a no-op on the host


def new_digest(t: torch.Tensor) -> "hashlib._Hash":
    """A tensor's sha256 before its bytes: its dtype and shape (the checksum's definition, checkpoint.py)."""
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: list[torch.Tensor], limit: int) -> list[list[int]]:
    """Tensor indices per shard, in order: each shard's tensors add up to at most ``limit`` (with their
    alignment) or are one tensor larger than that."""
    shards: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        need = nbytes(t) + ALIGN
        if not shards or (size + need > limit and size > 0):
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += need
    return shards


def shard_path(manifest: Path, write: str, index: int) -> Path:
    return manifest.with_name(f"{manifest.stem}-{write}-{index:05d}.shard")


class Writer:
    """A file being written: keeps the OSError that torch.save turns into a RuntimeError, counts the
    bytes, and every SYNC_BYTES flushes them to disk and drops them from the page cache (dirty pages of
    a 100 GB write would otherwise fill the memory, and in a container they count against its limit)."""

    def __init__(self, f: Any) -> None:
        self.f, self.error, self.pos, self._synced = f, None, 0, 0

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        self.pos += len(memoryview(data).cast("B"))
        if self.pos - self._synced >= SYNC_BYTES:
            self._sync()
        return n

    def _sync(self) -> None:
        try:
            self.f.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):  # not a real file (tests wrap it)
            return
        drop_written(self.f, self.pos)
        self._synced = self.pos

    def flush(self) -> None:
        self.f.flush()


class Stopped(Exception):
    """Another shard's write failed: this one stops too."""


@dataclass
class WrittenShard:
    offsets: list[int]
    digests: list[bytes]


def write_shard(path: Path, tensors: list[torch.Tensor], stop: threading.Event) -> WrittenShard:
    """One shard file, fsynced, and each tensor's offset in it and sha256 (taken from the written bytes)."""
    out = WrittenShard([], [])
    with open(path, "xb") as f:  # not mkstemp: a checkpoint gets the umask's permissions like any file
        writer = Writer(f)
        for t in tensors:
            writer.write(bytes(-writer.pos % ALIGN))
            out.offsets.append(writer.pos)
            h = new_digest(t)
            for chunk in chunks(t):
                if stop.is_set():
                    raise Stopped
                h.update(chunk)
                writer.write(chunk)
            out.digests.append(h.digest())
        f.flush()
        os.fsync(f.fileno())
    return out


def write_shards(paths: list[Path], groups: list[list[torch.Tensor]]) -> list[WrittenShard]:
    """Every shard, ``WRITERS`` at a time; the first failure stops the others and is raised."""
    stop = threading.Event()

    def one(args: tuple[Path, list[torch.Tensor]]) -> WrittenShard:
        try:
            return write_shard(*args, stop)
        except BaseException:
            stop.set()
            raise

    pool = ThreadPoolExecutor(max(1, min(WRITERS, len(paths))))
    try:
        futures = [pool.submit(one, args) for args in zip(paths, groups)]
        errors = [f.exception() for f in futures]
    except BaseException:  # an interrupt in this thread: the writers stop at their next chunk
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True)
    real = [e for e in errors if e is not None and not isinstance(e, Stopped)]
    if real:
        raise real[0]
    return [f.result() for f in futures]


def write_manifest(writer: Writer, record: dict[str, Any]) -> None:
    """MAGIC, the record, its offset, MAGIC."""
    writer.write(MAGIC)
    start = writer.pos
    torch.save(record, writer)
    writer.write(TRAILER.pack(start, MAGIC))


# ----------------------------------------------------------------------------- reading
def magic_of(path: Path) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC))
    except OSError:
        return None


def is_streamed(path: Path) -> bool:
    """Whether ``path`` starts like a manifest (this version's layout) or an earlier single streamed file."""
    return magic_of(path) in (MAGIC, MAGIC_SINGLE)


def _mapped(path: Path) -> Any:
    """The file's bytes, mapped private (writing a loaded tensor never reaches the file)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return bytearray()
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def read_record(path: Path) -> tuple[dict[str, Any], Any, int]:
    """A manifest's (or single file's) record, the mapped file, and where its record starts."""
    mapped = _mapped(path)
    if len(mapped) < len(MAGIC) + TRAILER.size:
        raise ValueError("shorter than a checkpoint's frame (cut short?)")
    start, magic = TRAILER.unpack(mapped[-TRAILER.size :])
    if magic != mapped[: len(MAGIC)] or not len(MAGIC) <= start <= len(mapped) - TRAILER.size:
        raise ValueError("no state record at its end (cut short?)")
    # weights_only: a checkpoint is data; loading one must not run code from it.
    record = torch.load(io.BytesIO(mapped[start : len(mapped) - TRAILER.size]), map_location="cpu", weights_only=True)
    return record, mapped, start


def shard_files(path: Path, record: Optional[dict] = None) -> list[Path]:
    """The shard files a manifest names (none for a single file)."""
    if record is None:
        record = read_record(path)[0]
    return [Path(path).with_name(name) for name in record.get("shards", [])]


def read_streamed(path: Path) -> tuple[dict[str, Any], list[Path]]:
    """A checkpoint's state, its tensors views of the mapped shards, and its shard files."""
    record, mapped, start = read_record(path)
    files = shard_files(path, record)
    data = []
    for f in files:
        if not f.is_file():
            raise ValueError(f"its shard {f.name} is missing (a checkpoint is its .pt file and the {path.stem}-*.shard files it names)")
        data.append(torch.frombuffer(_mapped(f), dtype=torch.uint8) if f.stat().st_size else torch.empty(0, dtype=torch.uint8))
    inside = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors = []
    for e in record["tensors"]:
        dtype, shape = DTYPES[e["dtype"]], [int(n) for n in e["shape"]]
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        source = data[int(e["shard"])] if "shard" in e else inside[:start]
        offset = int(e["offset"])
        if size == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        if offset % ALIGN or offset + size > len(source):
            raise ValueError(f"tensor {len(tensors)} lies outside its file's data")
        t = source[offset : offset + size].view(dtype).view(shape)
        tensors.append(t.clone() if size < OWN_BYTES else t)
    return filled(record["state"], tensors), files


def filled(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == TENSOR:
        return tensors[obj[1]]
    return rebuilt(obj, lambda v: filled(v, tensors))

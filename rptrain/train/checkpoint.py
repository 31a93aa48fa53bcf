"""Atomic, self-describing, verified checkpoints, streamed with bounded memory.

A checkpoint is one file holding everything a run needs to continue exactly: master weights and
buffers, optimizer, GradScaler and LR-schedule states, RNG states, the step, the data loader's
position and the metrics so far, plus a fingerprint of the model it belongs to and a sha256 checksum
of all of that, which loading recomputes: a flipped byte in tensor data is refused, never trained on.
A file is written to a temporary name in the same directory, fsynced and renamed into place, so a
crash or pre-emption mid-write leaves the previous one intact.

The file (``MAGIC`` first) is every tensor's bytes, each in its own dtype (an int8 optimizer state is
written as int8) on a 64-byte boundary, then the rest of the state as a small ``torch.save`` record
in which each tensor is a reference, then that record's offset and ``MAGIC`` again. Tensors are
written straight from where they live, a GPU's a chunk at a time, and the written pages are flushed
to disk and dropped from the page cache every ``SYNC_BYTES``: writing a 100 GB state needs a few
chunks of memory, not a second copy of it. Loading maps the file: its tensors are read when used.
Files of the older layout (one ``torch.save`` of the whole state) still load.

A run keeps its newest `keep` checkpoints as checkpoints/step-NNNNNNNN.pt; checkpoints/last.pt is a
second name (a hard link) of the newest.
"""
from __future__ import annotations

import errno
import hashlib
import io
import mmap
import os
import random
import re
import shutil
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .errors import CheckpointError, OutputError, one_line

FORMAT = "rptrain-checkpoint-v1"  # the marker inside the state, whatever the file layout
MAGIC = b"RPTCKPT2"  # a streamed checkpoint's first and last 8 bytes (an older one is a torch.save zip: "PK")
_TRAILER = struct.Struct("<Q8s")  # the state record's offset, MAGIC
_TENSOR = "\0rptrain-tensor"  # a tensor's place in the state record: (_TENSOR, index)
ALIGN = 64  # every tensor starts on this boundary, so the mapped file views as any dtype
CHUNK_BYTES = 64 * 2**20  # a GPU tensor is copied to the host this much at a time (and hashed in such pieces)
OWN_BYTES = 2**20  # a loaded tensor smaller than this gets memory of its own: some readers
# (torch.set_rng_state) take the storage's start, not a view's
SYNC_BYTES = 2**30  # written pages are flushed and dropped from the page cache this often
LAST = "last.pt"
_STEP = re.compile(r"step-(\d+)\.pt")
TEMP_GLOB = ".*.tmp"  # what a write in progress is called; a killed write leaves one behind
_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}

# Temporary files being written right now: a second signal that stops the process at once removes them.
in_flight: set[Path] = set()


def step_file(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def step_of(path: Path) -> Optional[int]:
    m = _STEP.fullmatch(Path(path).name)
    return int(m[1]) if m else None


def save_rotating(directory: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write directory/step-N.pt, make last.pt name it, and delete all but the newest `keep` step files.
    When the file system has no room for the new file beside the kept ones, the older ones go first
    (the newest always stays until the new one is written)."""
    path = step_file(directory, step)
    make_room(directory, state_nbytes(state))
    save_checkpoint(path, state)
    last = Path(directory) / LAST
    tmp = _temp_name(last)
    try:
        try:
            os.link(path, tmp)
        except OSError:  # a filesystem without hard links: a copy
            shutil.copyfile(path, tmp)
        os.replace(tmp, last)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _write_error(last, err) from err
    for old in checkpoint_files(directory)[keep:]:
        if old.name != LAST:
            old.unlink(missing_ok=True)
    return path


def make_room(directory: Path, nbytes: int) -> list[Path]:
    """Delete step files older than the newest while the file system has less than ``nbytes`` free
    (the newest is kept whatever happens: a failed write then still leaves it). Returns what went."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    gone = []
    older = [f for f in checkpoint_files(directory)[1:] if f.name != LAST]
    while older and shutil.disk_usage(directory).free < nbytes:
        victim = older.pop()  # the oldest
        victim.unlink(missing_ok=True)
        gone.append(victim)
    return gone


def checkpoint_files(directory: Path) -> list[Path]:
    """A run's step files, newest first; last.pt alone when it has none (a run of an older version)."""
    directory = Path(directory)
    steps = sorted((p for p in directory.glob("step-*.pt") if step_of(p) is not None), key=step_of, reverse=True)
    return steps or ([directory / LAST] if (directory / LAST).is_file() else [])


# ----------------------------------------------------------------------------- writing
def _unique_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` with each tensor replaced by (_TENSOR, index), and the tensors by index. A tensor met
    twice (a tied weight under two names, a step count shared by a run) is stored once and loads as one."""
    tensors: list[torch.Tensor] = []
    seen: dict[tuple, int] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key not in seen or t.numel() == 0:
                seen[key] = len(tensors)
                tensors.append(t)
            return (_TENSOR, seen[key])
        return _rebuilt(obj, walk)

    return walk(state), tensors


def _rebuilt(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to every value of its dicts, lists and tuples, keeping their types."""
    if isinstance(obj, dict):
        return type(obj)((k, fn(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    return obj


def state_nbytes(state: Any) -> int:
    """The bytes a checkpoint of ``state`` takes (its tensors' data; the rest is small)."""
    _, tensors = _unique_tensors(state)
    return sum(t.numel() * t.element_size() for t in tensors) + 2**20


def _chunks(t: torch.Tensor) -> Iterator[np.ndarray]:
    """``t``'s bytes in its standard (row-major) order as host uint8 arrays: views of a host tensor's
    memory, or copies of at most CHUNK_BYTES of a GPU tensor's."""
    t = t.detach().reshape(-1)  # a copy only for a non-contiguous tensor (one tensor, on its device)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.device.type == "cpu":
        if t.numel():
            yield t.view(torch.uint8).numpy()
        return
    step = max(1, CHUNK_BYTES // t.element_size())
    for start in range(0, t.numel(), step):
        yield t[start : start + step].cpu().view(torch.uint8).numpy()


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path = Path(path)
    tmp = _temp_name(path)
    payload = {"format": FORMAT, **state}
    payload["checksum"] = checksum(payload)
    writer = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        in_flight.add(tmp)
        # Not mkstemp: its files are private (0600); a checkpoint gets the umask's permissions like any file.
        with open(tmp, "xb") as f:
            writer = _Writer(f)
            _write_streamed(writer, payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        # torch.save reports a failed write as "enforce fail ... unexpected pos": name the real cause.
        cause = writer.error if writer is not None and writer.error is not None else err
        if isinstance(cause, OSError):
            raise _write_error(path, cause) from err
        raise
    finally:
        in_flight.discard(tmp)


def _write_streamed(writer: "_Writer", payload: dict[str, Any]) -> None:
    """MAGIC, every tensor's bytes (aligned), the state record with references, its offset, MAGIC."""
    record, tensors = _unique_tensors(payload)
    writer.write(MAGIC)
    entries = []
    for t in tensors:
        writer.write(bytes(-writer.pos % ALIGN))
        offset = writer.pos
        for chunk in _chunks(t):
            writer.write(chunk)
        entries.append({"offset": offset, "dtype": str(t.dtype), "shape": list(t.shape)})
    start = writer.pos
    torch.save({"format": FORMAT, "tensors": entries, "state": record}, writer)
    writer.write(_TRAILER.pack(start, MAGIC))


class _Writer:
    """The file a checkpoint is written to: keeps the OSError that torch.save turns into a
    RuntimeError, counts the bytes, and every SYNC_BYTES flushes them to disk and drops them from
    the page cache (dirty pages of a 100 GB write would otherwise fill the memory, and in a
    container they count against its limit)."""

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
            fd = self.f.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):  # not a real file (tests wrap it)
            return
        self.f.flush()
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, self.pos, os.POSIX_FADV_DONTNEED)
        self._synced = self.pos

    def flush(self) -> None:
        self.f.flush()


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _write_error(path: Path, err: OSError) -> OutputError:
    cause = err.strerror or one_line(err)
    code = f" ({errno.errorcode[err.errno]})" if err.errno in errno.errorcode else ""
    fix = "free some space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
    return OutputError(f"cannot write checkpoint {path}: {cause}{code}: {fix}, or set output_root to another filesystem; the previous checkpoint is kept")


# ----------------------------------------------------------------------------- checksum
def _leaves(obj: Any, key: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{key}/{k!r}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{key}/{i}")
    else:
        yield key, obj


def _tensor_digest(t: torch.Tensor) -> bytes:
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    for chunk in _chunks(t):  # the raw bytes, whatever the dtype (bf16 has no numpy type)
        h.update(chunk)
    return h.digest()


def checksum(state: dict[str, Any]) -> str:
    """sha256 over every value of the state (tensors by their bytes, the rest by repr), with its place in it."""
    leaves = list(_leaves({k: v for k, v in state.items() if k != "checksum"}, ""))
    tensors = [v for _, v in leaves if isinstance(v, torch.Tensor)]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL on big buffers
        digests = iter(list(pool.map(_tensor_digest, tensors)))
    h = hashlib.sha256()
    for key, value in leaves:
        h.update(key.encode())
        h.update(next(digests) if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- loading
def is_streamed(path: Path) -> bool:
    """Whether ``path`` starts like a streamed checkpoint (this version's layout)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _read_streamed(path: Path) -> dict[str, Any]:
    """A streamed checkpoint, its tensors views of the memory-mapped file (private: writing one
    never reaches the file)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    start, magic = _TRAILER.unpack(mapped[-_TRAILER.size :])
    if magic != MAGIC or not len(MAGIC) <= start <= len(mapped) - _TRAILER.size:
        raise ValueError("no state record at its end (cut short?)")
    record = torch.load(io.BytesIO(mapped[start : len(mapped) - _TRAILER.size]), map_location="cpu", weights_only=True)
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors = []
    for e in record["tensors"]:
        dtype, shape = _DTYPES[e["dtype"]], [int(n) for n in e["shape"]]
        numel = int(np.prod(shape, dtype=np.int64))
        offset, nbytes = int(e["offset"]), numel * dtype.itemsize
        if offset % ALIGN or offset + nbytes > start:
            raise ValueError(f"tensor {len(tensors)} lies outside the file's data")
        t = data[offset : offset + nbytes].view(dtype).view(shape)
        tensors.append(t.clone() if nbytes < OWN_BYTES else t)
    return _filled(record["state"], tensors)


def _filled(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == _TENSOR:
        return tensors[obj[1]]
    return _rebuilt(obj, lambda v: _filled(v, tensors))


def load_checkpoint(path: Path, expected: Optional[dict] = None) -> dict[str, Any]:
    """Read a checkpoint (memory-mapped: big models are not read twice), verify its checksum and fingerprint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found: set trainer.resume to a checkpoint file or run directory")
    try:
        # weights_only: a checkpoint is data; loading one must not run code from it.
        state = _read_streamed(path) if is_streamed(path) else torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a checkpoint ({one_line(err)[:200]}): "
            f"resume from another one or start fresh with trainer.resume=null"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an rptrain checkpoint (no '{FORMAT}' marker): point trainer.resume at a checkpoints/last.pt")
    verify(path, state)
    if expected is not None:
        check_fingerprint(path, state.get("fingerprint") or {}, expected)
    return state


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is an rptrain checkpoint file (either layout), read without verifying it."""
    path = Path(path)
    if not path.is_file():
        return False
    if is_streamed(path):
        return True
    try:  # memory-mapped: telling a checkpoint from a plain state dict reads next to nothing
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return isinstance(state, dict) and state.get("format") == FORMAT


_verified: dict[tuple, bool] = {}  # (path, inode, size, mtime) -> checksum matched: the pre-run check and the run read one file


def verify(path: Path, state: dict) -> None:
    st = path.stat()
    key = (str(path.absolute()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _verified:
        _verified[key] = state.get("checksum") == checksum(state)
    if not _verified[key]:
        raise CheckpointError(
            f"checkpoint {path} fails its checksum (damaged on disk or in transit): "
            f"resume from an older one (checkpoints/step-*.pt) or start fresh with trainer.resume=null"
        )


def check_fingerprint(path: Path, found: dict, expected: dict) -> None:
    if found == expected:
        return
    what = (
        f"{found.get('model')} ({found.get('params', 0):,} parameters)"
        if found.get("model") != expected["model"] or found.get("params") != expected["params"]
        else f"{found.get('model')} with other layer shapes"
    )
    raise CheckpointError(
        f"checkpoint {path} was written for {what} but this run builds {expected['model']} "
        f"({expected['params']:,} parameters): resume with the model config it was written with, or start fresh with trainer.resume=null"
    )


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _plain(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(obj: Any) -> Any:
    """random.getstate() as lists, which weights_only loading accepts."""
    return [_plain(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _tuples(obj: Any) -> Any:
    return tuple(_tuples(x) for x in obj) if isinstance(obj, list) else obj

"""Atomic, self-describing, verified checkpoints.

A checkpoint is one torch.save file holding everything a run needs to continue exactly:
master weights and buffers, optimizer, GradScaler and LR-schedule states, RNG states, the step,
the data loader's position and the metrics so far, plus a fingerprint of the model it belongs to
and a sha256 checksum of all of that, which loading recomputes: a flipped byte in tensor data is
refused, never trained on. A file is written to a temporary name in the same directory, fsynced
and renamed into place, so a crash or pre-emption mid-write leaves the previous one intact.

A run keeps its newest `keep` checkpoints as checkpoints/step-NNNNNNNN.pt; checkpoints/last.pt is a
second name (a hard link) of the newest.
"""
from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from .errors import CheckpointError, OutputError, one_line

FORMAT = "rptrain-checkpoint-v1"
LAST = "last.pt"
_STEP = re.compile(r"step-(\d+)\.pt")
TEMP_GLOB = ".*.tmp"  # what a write in progress is called; a killed write leaves one behind

# Temporary files being written right now: a second signal that stops the process at once removes them.
in_flight: set[Path] = set()


def step_file(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def step_of(path: Path) -> Optional[int]:
    m = _STEP.fullmatch(Path(path).name)
    return int(m[1]) if m else None


def save_rotating(directory: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write directory/step-N.pt, make last.pt name it, and delete all but the newest `keep` step files."""
    path = step_file(directory, step)
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


def checkpoint_files(directory: Path) -> list[Path]:
    """A run's step files, newest first; last.pt alone when it has none (a run of an older version)."""
    directory = Path(directory)
    steps = sorted((p for p in directory.glob("step-*.pt") if step_of(p) is not None), key=step_of, reverse=True)
    return steps or ([directory / LAST] if (directory / LAST).is_file() else [])


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
            torch.save(payload, writer)
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


class _Writer:
    """The file torch.save writes to, keeping the OSError that torch turns into a RuntimeError."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

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
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.numel():
        h.update(t.view(torch.uint8).numpy())  # the raw bytes, whatever the dtype (bf16 has no numpy type)
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
def load_checkpoint(path: Path, expected: Optional[dict] = None) -> dict[str, Any]:
    """Read a checkpoint (memory-mapped: big models are not read twice), verify its checksum and fingerprint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found: set trainer.resume to a checkpoint file or run directory")
    try:
        # weights_only: a checkpoint is data; loading one must not run code from it.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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

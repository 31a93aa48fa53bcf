"""Atomic, self-describing, verified checkpoints, sharded and streamed with bounded memory.

A checkpoint holds everything a run needs to continue exactly: master weights and buffers,
optimizer, GradScaler and LR-schedule states, RNG states, the step, the data loader's position and the
metrics so far, plus a fingerprint of the model it belongs to and a sha256 checksum of all of that,
which loading recomputes: a flipped byte in tensor data is refused, never trained on.

On disk it is a manifest file and its shards (checkpoint_layout.py). The shards are written first,
under names no other write uses; the manifest is written to a temporary name, fsynced and renamed
into place, and only then is the checkpoint complete: a crash or pre-emption mid-write leaves the
previous one intact, and shards without a manifest, which the next write (or the next run in the
directory) removes. Replacing or deleting a checkpoint removes its shards too, unless another
manifest (last.pt) names them. Files of the older layouts (one streamed file; one ``torch.save``)
still load.

A run keeps its newest `keep` checkpoints as checkpoints/step-NNNNNNNN.pt with their shards;
checkpoints/last.pt is a second name (a hard link, else a copy of the small manifest) of the newest.
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

from . import checkpoint_layout as layout
from .errors import CheckpointError, OutputError, one_line

FORMAT = "rptrain-checkpoint-v1"  # the marker inside the state, whatever the file layout
LAST = "last.pt"
_STEP = re.compile(r"step-(\d+)\.pt")

# Files being written right now: a second signal that stops the process at once removes them.
in_flight: set[Path] = set()


def step_file(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def step_of(path: Path) -> Optional[int]:
    m = _STEP.fullmatch(Path(path).name)
    return int(m[1]) if m else None


def save_rotating(directory: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write directory/step-N.pt, make last.pt name it, and delete all but the newest `keep` checkpoints.
    When the file system has no room for the new one beside the kept ones, the older ones go first
    (the newest always stays until the new one is written)."""
    directory = Path(directory)
    path = step_file(directory, step)
    make_room(directory, state_nbytes(state))
    save_checkpoint(path, state)
    last = directory / LAST
    tmp = _temp_name(last)
    try:
        try:
            os.link(path, tmp)
        except OSError:  # a filesystem without hard links: a copy of the manifest (the shards are shared)
            shutil.copyfile(path, tmp)
        os.replace(tmp, last)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _write_error(last, err) from err
    for old in checkpoint_files(directory)[keep:]:
        if old.name != LAST:
            old.unlink(missing_ok=True)
    remove_unnamed_shards(directory)
    return path


def make_room(directory: Path, nbytes: int) -> list[Path]:
    """Delete checkpoints older than the newest while the file system has less than ``nbytes`` free
    (the newest is kept whatever happens: a failed write then still leaves it). Returns what went."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    gone = []
    older = [f for f in checkpoint_files(directory)[1:] if f.name != LAST]
    while older and shutil.disk_usage(directory).free < nbytes:
        victim = older.pop()  # the oldest
        victim.unlink(missing_ok=True)
        remove_unnamed_shards(directory)
        gone.append(victim)
    return gone


def checkpoint_files(directory: Path) -> list[Path]:
    """A run's step checkpoints (their manifests), newest first; last.pt alone when it has none (a run of an older version)."""
    directory = Path(directory)
    steps = sorted((p for p in directory.glob("step-*.pt") if step_of(p) is not None), key=step_of, reverse=True)
    return steps or ([directory / LAST] if (directory / LAST).is_file() else [])


def _named_shards(directory: Path) -> set[str]:
    """The shards some manifest in ``directory`` names (an unreadable manifest names none)."""
    named: set[str] = set()
    for manifest in Path(directory).glob("*.pt"):
        if layout.magic_of(manifest) == layout.MAGIC:
            try:
                named.update(_shard_names(manifest))
            except Exception:  # damaged: its shards are of no use
                continue
    return named


# The shard names of the manifests already read or written, by file identity (a manifest is never rewritten in
# place: a new one is a new file). Reading them means unpickling each manifest's whole record (Python, holding the
# GIL): a background write did it for every manifest in the directory twice per save, 47 ms for the main job's
# ResNet-34 on the CI machine, while the training thread waited for the GIL to go on: the one slow log window an
# epoch (bench/README, twenty-third session).
_names_by_file: dict[tuple[int, int, int, int], frozenset[str]] = {}


def _file_identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _shard_names(manifest: Path) -> frozenset[str]:
    key = _file_identity(manifest)
    names = _names_by_file.get(key)
    if names is None:
        names = frozenset(p.name for p in layout.shard_files(manifest))
        _remember_shard_names(key, names)
    return names


def _remember_shard_names(key: tuple[int, int, int, int], names: frozenset[str]) -> None:
    if len(_names_by_file) >= 1024:  # a bound for a process that writes to many directories
        _names_by_file.clear()
    _names_by_file[key] = names


def remove_unnamed_shards(directory: Path) -> list[Path]:
    """Remove the shard files in ``directory`` that no manifest names (a killed write's, a replaced or
    deleted checkpoint's); only names of the shard pattern are touched. Returns what went."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    named = _named_shards(directory)
    gone = [p for p in directory.iterdir() if layout.SHARD_NAME.fullmatch(p.name) and p.name not in named]
    for p in gone:
        p.unlink(missing_ok=True)
    return sorted(gone)


def checkpoint_nbytes(path: Path) -> int:
    """The bytes a checkpoint takes on disk: its manifest and its shards."""
    path = Path(path)
    size = path.stat().st_size
    if layout.magic_of(path) == layout.MAGIC:
        try:
            size += sum(f.stat().st_size for f in layout.shard_files(path) if f.is_file())
        except Exception:  # damaged: only what is there counts
            pass
    return size


# ----------------------------------------------------------------------------- writing
def state_nbytes(state: Any) -> int:
    """The bytes a checkpoint of ``state`` takes (its tensors' data; the rest is small)."""
    _, tensors = layout.unique_tensors(state)
    return sum(layout.nbytes(t) + layout.ALIGN for t in tensors) + 2**20


def snapshot(state: Any, memory: Optional["SnapshotMemory"] = None) -> Any:
    """A copy of ``state`` that training cannot change: its tensors copied to host memory (``memory``'s, reused
    by every checkpoint of a run, else new), its dicts, lists and tuples rebuilt (layout.rebuilt); a tensor met
    twice (layout.tensor_key: a tied weight) is copied once, so the checkpoint stores it once, as it would the
    live state."""
    skeleton, tensors = layout.unique_tensors(state)
    copies = (memory or SnapshotMemory()).copy(tensors)
    return layout.filled(skeleton, copies)


class SnapshotMemory:
    """Host memory for a run's background checkpoints, allocated at the first and reused by each later one (the
    caller waits for a write before the next snapshot). Pinned where a tensor is on a GPU: the copies then go at
    the link's speed instead of through the driver's staging buffer, and no fresh memory is faulted in and freed
    at every epoch's end (ResNet-34's 256 MB, the main job's checkpoint)."""

    def __init__(self) -> None:
        self._flat: Optional[torch.Tensor] = None

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [-(-layout.nbytes(t) // layout.ALIGN) * layout.ALIGN for t in tensors]
        gpus = {t.device for t in tensors if t.is_cuda}
        if self._flat is None or self._flat.numel() < sum(sizes) or (gpus and not self._flat.is_pinned()):
            self._flat = None  # the old one freed before the new one is taken
            self._flat = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=bool(gpus))
        copies, offset = [], 0
        for t, size in zip(tensors, sizes):
            view = self._flat[offset : offset + layout.nbytes(t)].view(t.dtype).view(t.shape)
            copies.append(view.copy_(t, non_blocking=True))
            offset += size
        for device in gpus:  # the copies are done before training goes on to change the state
            torch.cuda.current_stream(device).synchronize()
        return copies

    def release(self) -> None:
        self._flat = None


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write the shards, then the manifest under a temporary name, renamed into place: complete or absent."""
    path = Path(path)
    payload = {"format": FORMAT, **state}
    record, tensors = layout.unique_tensors(payload)
    groups = layout.plan_shards(tensors, layout.SHARD_BYTES)
    write = uuid.uuid4().hex[:8]
    shards = [layout.shard_path(path, write, k) for k in range(len(groups))]
    tmp = _temp_name(path)
    replaced = _shards_of(path)
    ours = [*shards, tmp]
    in_flight.update(ours)
    writer = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        written = layout.write_shards(shards, [[tensors[i] for i in g] for g in groups])
        entries, digests = [None] * len(tensors), {}
        for k, (g, w) in enumerate(zip(groups, written)):
            for i, offset, digest in zip(g, w.offsets, w.digests):
                t = tensors[i]
                entries[i] = {"shard": k, "offset": offset, "dtype": str(t.dtype), "shape": list(t.shape)}
                digests[layout.tensor_key(t)] = digest
        record["checksum"] = checksum(payload, digests)
        with open(tmp, "xb") as f:
            writer = layout.Writer(f)
            layout.write_manifest(writer, {"format": FORMAT, "shards": [s.name for s in shards], "tensors": entries, "state": record})
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _remember_shard_names(_file_identity(path), frozenset(s.name for s in shards))
        dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as err:
        for p in ours:
            p.unlink(missing_ok=True)
        # torch.save reports a failed write as "enforce fail ... unexpected pos": name the real cause.
        cause = writer.error if writer is not None and writer.error is not None else err
        if isinstance(cause, OSError):
            raise _write_error(path, cause) from err
        raise
    finally:
        in_flight.difference_update(ours)
    if replaced:  # the shards of the checkpoint this one replaced, unless another name of it (last.pt) remains
        named = _named_shards(path.parent)
        for old in replaced:
            if old.name not in named:
                old.unlink(missing_ok=True)


def _shards_of(path: Path) -> list[Path]:
    """The shards of the checkpoint at ``path`` now, if it is one of this layout."""
    if layout.magic_of(path) != layout.MAGIC:
        return []
    try:
        return [path.with_name(name) for name in sorted(_shard_names(path))]
    except Exception:
        return []


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
    h = layout.new_digest(t)
    for chunk in layout.chunks(t):  # the raw bytes, whatever the dtype (bf16 has no numpy type)
        h.update(chunk)
    return h.digest()


def checksum(state: dict[str, Any], known: Optional[dict[tuple, bytes]] = None) -> str:
    """sha256 over every value of the state (tensors by their bytes, the rest by repr), with its place in it.
    ``known``: tensor digests already taken (the writer takes them from the bytes it writes), by layout.tensor_key."""
    known = known or {}
    leaves = list(_leaves({k: v for k, v in state.items() if k != "checksum"}, ""))
    tensors = [v for _, v in leaves if isinstance(v, torch.Tensor) and layout.tensor_key(v.detach()) not in known]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL on big buffers
        digests = iter(list(pool.map(_tensor_digest, tensors)))
    h = hashlib.sha256()
    for key, value in leaves:
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(known.get(layout.tensor_key(value.detach())) or next(digests))
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- loading
def _read(path: Path) -> tuple[dict[str, Any], list[Path]]:
    """The state in any layout (this one, the single streamed file, one torch.save), and its shard files."""
    if layout.is_streamed(path):
        return layout.read_streamed(path)
    # weights_only: a checkpoint is data; loading one must not run code from it.
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True), []


def load_checkpoint(path: Path, expected: Optional[dict] = None) -> dict[str, Any]:
    """Read a checkpoint (memory-mapped: big models are not read twice), verify its checksum and fingerprint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found: set trainer.resume to a checkpoint file or run directory")
    try:
        state, shards = _read(path)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a checkpoint ({one_line(err)[:200]}): "
            f"resume from another one or start fresh with trainer.resume=null"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an rptrain checkpoint (no '{FORMAT}' marker): point trainer.resume at a checkpoints/last.pt")
    verify(path, state, shards)
    if expected is not None:
        check_fingerprint(path, state.get("fingerprint") or {}, expected)
    return state


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is an rptrain checkpoint (its manifest, or a file of an older layout), read without verifying it."""
    path = Path(path)
    if not path.is_file():
        return False
    if layout.is_streamed(path):
        return True
    try:  # memory-mapped: telling a checkpoint from a plain state dict reads next to nothing
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return isinstance(state, dict) and state.get("format") == FORMAT


_verified: dict[tuple, bool] = {}  # (path, inode, size, mtime) of each file -> checksum matched: the pre-run check and the run read one checkpoint


def verify(path: Path, state: dict, shards: list[Path] = ()) -> None:
    key = tuple((str(p.absolute()), st.st_ino, st.st_size, st.st_mtime_ns) for p in (path, *shards) for st in [p.stat()])
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

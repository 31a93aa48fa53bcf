"""Atomic, self-describing checkpoints.

A checkpoint is one torch.save file holding everything a run needs to continue exactly:
master weights and buffers, optimizer, GradScaler and LR-schedule states, RNG states, the step,
the data loader's position and the metrics so far, plus a fingerprint of the model it belongs to.
It is written to a temporary file in the same directory, fsynced and renamed over the old one,
so a crash or pre-emption mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import random
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

from .errors import CheckpointError, one_line

FORMAT = "rptrain-checkpoint-v1"
LAST = "last.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its files are private (0600); a checkpoint gets the umask's permissions like any file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path, expected: Optional[dict] = None) -> dict[str, Any]:
    """Read a checkpoint (memory-mapped: big models are not read twice) and check its fingerprint."""
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
    if expected is not None:
        check_fingerprint(path, state.get("fingerprint") or {}, expected)
    return state


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

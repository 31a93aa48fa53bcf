"""Which checkpoint trainer.resume means.

  null   start fresh;
  auto   the newest checkpoints/last.pt under output_root (or in this run's directory) of a run
         started with the same overrides, apart from trainer.resume itself; fresh if none. The
         same command therefore continues after a pre-emption or a SLURM requeue, and each job of
         a sweep finds its own checkpoint;
  PATH   a checkpoint file, or a run directory holding checkpoints/last.pt.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from .checkpoint import LAST
from .errors import CheckpointError


def job_key(overrides: Iterable[str]) -> tuple[str, ...]:
    """The overrides that identify a run: all but trainer.resume, in a canonical order."""
    return tuple(sorted(o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "trainer.resume"))


def resolve_resume(resume: Optional[str], output_root: Path, run_dir: Optional[Path], overrides: Iterable[str]) -> Optional[Path]:
    if resume is None:
        return None
    if resume == "auto":
        found = newest_matching(Path(output_root), run_dir, job_key(overrides))
        return found.absolute() if found else None
    path = Path(resume).expanduser().absolute()
    if path.is_dir():
        for candidate in (path / "checkpoints" / LAST, path / LAST):
            if candidate.is_file():
                return candidate
        raise CheckpointError(f"trainer.resume={resume}: no checkpoints/{LAST} in that directory: point it at a run directory with a checkpoint or at a .pt file")
    if not path.is_file():
        raise CheckpointError(f"trainer.resume={resume}: no such checkpoint file or run directory: fix the path, use trainer.resume=auto, or start fresh with trainer.resume=null")
    return path


def newest_matching(output_root: Path, run_dir: Optional[Path], key: tuple[str, ...]) -> Optional[Path]:
    candidates = set(output_root.glob(f"**/checkpoints/{LAST}")) if output_root.is_dir() else set()
    if run_dir is not None and (Path(run_dir) / "checkpoints" / LAST).is_file():
        candidates.add(Path(run_dir) / "checkpoints" / LAST)
    matching = [c for c in candidates if _run_overrides(c.parent.parent) == key]
    return max(matching, key=lambda c: c.stat().st_mtime) if matching else None


def _run_overrides(run_dir: Path) -> Optional[tuple[str, ...]]:
    """The overrides Hydra recorded for a run (.hydra/overrides.yaml), or None if unreadable."""
    try:
        return job_key(OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")))
    except Exception:  # a half-written or foreign directory: not a candidate
        return None


def global_batch(loader_state: dict) -> Optional[int]:
    """The global batch a loader state was saved with: per-rank batch x world size."""
    if loader_state.get("batch_size") is None:
        return None
    return int(loader_state["batch_size"]) * int(loader_state.get("world_size") or 1)


def check_resume_state(path: Path, state: dict, cfg: DictConfig) -> None:
    """What the fingerprint does not cover but an exact resume needs: the same global batch
    (the number of processes may differ: the data position counts global batches)."""
    saved = global_batch(state.get("loader") or {})
    if saved is not None and saved != cfg.trainer.batch_size:
        raise CheckpointError(
            f"checkpoint {path} was written with trainer.batch_size={saved} but this run has "
            f"trainer.batch_size={cfg.trainer.batch_size}: resume with the same batch size (the data order depends on it)"
        )


def loader_state_for(state: dict, batch_size: int, world_size: int) -> dict:
    """A loader state saved by another number of ranks, for this one. Rank r reads positions
    r, r+W, ... of every epoch's permutation, so a global batch is the same samples for any W that
    divides it, and the position (epoch, batch) counts global batches: only the split changes."""
    if global_batch(state) == batch_size * world_size:
        return {**state, "batch_size": batch_size, "world_size": world_size}
    return state  # not the same global batch: the loader refuses it with its own message

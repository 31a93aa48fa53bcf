"""Which checkpoint trainer.resume means.

  null   start fresh;
  auto   the newest checkpoint under output_root (or in this run's directory) of a run started
         with the same overrides, apart from trainer.resume itself, that no live process owns;
         fresh if none. The run then continues in that run's directory. The same command
         therefore continues after a pre-emption or a SLURM requeue, and each job of a sweep finds
         its own checkpoint;
  PATH   a checkpoint file, or a run directory holding checkpoints.

Every candidate is verified (checkpoint.load_checkpoint checks its checksum); for auto and a run
directory, a newer checkpoint that fails is skipped for the newest that passes, and the run says
so. A file named explicitly must pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from . import rundir
from .checkpoint import checkpoint_files, load_checkpoint
from .errors import CheckpointError, OutputError


@dataclass
class Choice:
    path: Optional[Path] = None  # the checkpoint to load; None: start fresh
    run_dir: Optional[Path] = None  # auto: the run it belongs to, which continues in place
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that failed verification, with why

    def note(self) -> Optional[str]:
        if not self.skipped:
            return None
        return f"{'; '.join(self.skipped)}: resuming from the newest checkpoint that verifies, {self.path}"


def job_key(overrides: Iterable[str]) -> tuple[str, ...]:
    """The overrides that identify a run: all but trainer.resume and Hydra's own (hydra.run.dir=...:
    .hydra/overrides.yaml holds the job's alone), in a canonical order."""
    keys = {o: o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return tuple(sorted(o for o, k in keys.items() if k != "trainer.resume" and not k.startswith(("hydra.", "hydra/"))))


def resolve_resume(resume: Optional[str], output_root: Path, run_dir: Optional[Path], overrides: Iterable[str]) -> Choice:
    if resume is None:
        return Choice()
    if resume == "auto":
        return _first_verified(_auto_candidates(Path(output_root), run_dir, job_key(overrides)), "trainer.resume=auto", owned=True)
    path = Path(resume).expanduser().absolute()
    if path.is_dir():
        files = checkpoint_files(path / "checkpoints") or checkpoint_files(path)
        if not files:
            raise CheckpointError(f"trainer.resume={resume}: no checkpoints/ in that directory: point it at a run directory with a checkpoint or at a .pt file")
        return _first_verified([(f, path) for f in files], f"trainer.resume={resume}", owned=False)
    if not path.is_file():
        raise CheckpointError(f"trainer.resume={resume}: no such checkpoint file or run directory: fix the path, use trainer.resume=auto, or start fresh with trainer.resume=null")
    return Choice(path)


def _auto_candidates(output_root: Path, run_dir: Optional[Path], key: tuple[str, ...]) -> list[tuple[Path, Path]]:
    """(checkpoint, run directory) of every run with these overrides, newest first. When the newest belongs to a
    live process (this command twice: a duplicated job, a requeue while the first still runs), OutputError:
    the second neither shares the directory nor silently starts the run over."""
    runs = {p.parent for p in output_root.glob("**/checkpoints")} if output_root.is_dir() else set()
    if run_dir is not None and (Path(run_dir) / "checkpoints").is_dir():
        runs.add(Path(run_dir))
    files = sorted(((f.absolute(), run.absolute()) for run in runs if _run_overrides(run) == key
                    for f in checkpoint_files(run / "checkpoints")), key=lambda fr: fr[0].stat().st_mtime, reverse=True)
    owners = {run: rundir.owned_elsewhere(run) for run in {run for _, run in files}}
    if files and owners[files[0][1]] is not None:
        run, who = files[0][1], owners[files[0][1]]
        raise OutputError(f"trainer.resume=auto: {run} is this run, and a live process is continuing it (pid {who.get('pid', '?')} "
                          f"on {who.get('host', '?')}, started {who.get('started', '?')}): wait for it to end (then run this again), "
                          f"or start a separate run with trainer.resume=null")
    return [(f, run) for f, run in files if owners[run] is None]


def _first_verified(candidates: list[tuple[Path, Path]], what: str, owned: bool) -> Choice:
    skipped = []
    for path, run in candidates:
        try:
            load_checkpoint(path)
        except CheckpointError as err:
            skipped.append(str(err).split(": ")[0])  # "checkpoint PATH fails its checksum (...)"
            continue
        return Choice(path, run if owned else None, skipped)
    if skipped:
        raise CheckpointError(f"{what}: no checkpoint passes verification ({'; '.join(skipped)}): start fresh with trainer.resume=null")
    return Choice()


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

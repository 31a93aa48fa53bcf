"""A run's checkpoints: which one it resumes from, restoring it, and writing the next one.

The file format (atomic, verified) is checkpoint.py's; this is what a run puts in it and takes out.
Under torchrun rank 0 chooses the checkpoint for everyone and alone writes; every rank takes part in
the synchronisation before a write, so all of them compute with the same weights afterwards.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig
from rich.console import Console

from rptrain import GradScaler, RoundPipe

from .checkpoint import LAST, SnapshotMemory, rng_state, save_rotating, set_rng_state, snapshot, state_nbytes
from .console import log, say
from .data import TrainData
from .dist import Dist, FailedOnRankZero
from .errors import CheckpointError, one_line
from .meters import RunProgress, global_progress, progress_from, progress_state
from .metrics import MetricsLog
from .resume import loader_state_for, resolve_resume
from .shown_config import shown_config


def choose_resume(cfg: DictConfig, run_dir: Path, overrides: list[str], d: Dist, console: Console) -> Optional[Path]:
    """Rank 0 picks the checkpoint and every rank loads that file (trainer.resume=auto on each
    rank could see a newer file appear, or another filesystem)."""
    found, error = None, None
    if d.main:
        try:
            choice = resolve_resume(cfg.trainer.resume, Path(cfg.output_root), run_dir, overrides)
            found = choice.path
            if choice.note():
                say(console, choice.note())
        except CheckpointError as err:
            if d.world == 1:
                raise
            error = err
    path, message = d.broadcast((str(found) if found else None, str(error) if error else None), "the choice of a checkpoint to resume from")
    if error is not None:
        raise error
    if message is not None:
        raise FailedOnRankZero(message)
    if cfg.trainer.resume == "auto" and path is None:
        say(console, f"trainer.resume=auto: no checkpoint of a run with these overrides under {cfg.output_root}: starting fresh")
    return Path(path) if path else None


def restore(state: dict, path: Path, engine: RoundPipe, optimizer: Any, scheduler: Any, scaler: GradScaler,
            data: TrainData, console: Console) -> RunProgress:
    """Put a loaded checkpoint's states into the run's parts; a checkpoint of another config is one line."""
    try:
        engine.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler.is_enabled() and state["scaler"]:  # fp16 -> bf16/fp32 (or back) keeps no scale
            scaler.load_state_dict(state["scaler"])
        data.train.load_state_dict(loader_state_for(state["loader"], data.train.batch_size, data.train.world_size))
        progress = progress_from(state["progress"])
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path} does not fit this run ({one_line(err)[:300]}): resume with the config it was written with") from err
    set_rng_state(state["rng"])
    say(console, f"resumed from {path} at step {progress.step}")
    return progress


# A checkpoint of at most this many bytes may be copied to host memory and written by a background thread while
# training goes on (save(background=True)); a larger one is written from where it lives, with training waiting (a
# copy of a 32 B model's state would not fit the host). The main job's ResNet-34 writes 256 MB at every epoch's
# end; on the 2-core CI machine (`rptrain model=resnet34 data=synthetic trainer.checkpoint_interval=1`, cProfile of
# the loop's thread) a checkpoint took 0.75 s of the loop written in place, 0.08 s handed over (the copy 0.02 s).
BACKGROUND_MAX_BYTES = 2**30


class RunCheckpoints:
    """Writes checkpoints/step-N.pt (+ last.pt) and remembers the step of the newest one.

    At most one write is in flight: every save waits for the one before, and so do ``wait`` and ``close``;
    a background write's error is raised there (the checkpoint it names is absent; the one before it is kept)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, overrides: list[str], fingerprint: dict, d: Dist,
                 param_names: set[str], last_step: int = -1) -> None:
        self.cfg, self.overrides, self.fingerprint, self.dist = cfg, overrides, fingerprint, d
        self.path = Path(run_dir) / "checkpoints" / LAST
        self.param_names = param_names  # compared across ranks (BatchNorm buffers differ per rank)
        self.last_step = last_step  # a resumed run: the checkpoint it resumed from is the newest there is
        self._pending: Optional[tuple[Future, int]] = None  # a background write, and the newest step on disk before it
        self._writer: Optional[ThreadPoolExecutor] = None
        self._memory = SnapshotMemory()  # a background write's copy of the state, the same memory each time

    def kept(self) -> str:
        """What a failure leaves behind, for its message."""
        if self.last_step < 0:
            return "no checkpoint was written yet"
        return f"the last checkpoint (step {self.last_step}, {self.path}) is kept"

    def save(self, p: RunProgress, engine: RoundPipe, optimizer: Any, scheduler: Any, scaler: GradScaler,
             data: TrainData, metrics: MetricsLog, background: bool = False) -> None:
        """``background``: a small state (BACKGROUND_MAX_BYTES, one process) is copied and written while training
        goes on, once an earlier checkpoint is on disk; the run's first and last checkpoints and a stop's are
        written before this returns."""
        self.wait()
        engine.synchronize()  # the master weights after this step, and no step in flight (every rank: same weights)
        before, self.last_step = self.last_step, p.step
        total = global_progress(p, self.dist)
        model_state = engine.master_state()  # nothing copied: the writer streams a GPU share a chunk at a time
        d = self.dist
        if d.world > 1:  # cheap next to writing the file, and the one place a divergence would do harm
            d.check_same({k: v for k, v in model_state.items() if k in self.param_names}, "weights")
            log.info(f"step {p.step}: the {d.world} ranks hold identical weights")
        if not d.main:
            return
        state = {
            "fingerprint": self.fingerprint,
            "model": model_state,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),  # our lambda is a closure: saved as None, rebuilt from the config
            "scaler": scaler.state_dict(),
            "loader": data.train.state_dict(),
            "rng": rng_state(),
            "progress": progress_state(total),
            "history": metrics.records,
            "config": shown_config(self.cfg),  # resolved, but a value from the environment as written
            "overrides": self.overrides,
        }
        # In the background only with a complete checkpoint on disk to fall back on: a second signal (signals.py) stops
        # the process at once and removes what it cut short, which must not leave the run with none at all.
        if background and before >= 0 and d.world == 1 and state_nbytes(state) <= BACKGROUND_MAX_BYTES:
            self._writer = self._writer or ThreadPoolExecutor(1, thread_name_prefix="rptrain-checkpoint")
            write = self._writer.submit(save_rotating, self.path.parent, snapshot(state, self._memory), p.step, self.cfg.trainer.keep_checkpoints)
            self._pending = (write, before)
        else:
            save_rotating(self.path.parent, state, p.step, self.cfg.trainer.keep_checkpoints)
        metrics.write_csv()

    def wait(self) -> None:
        """Until the checkpoint being written is on disk; its write's error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            write, before = pending
            try:
                write.result()
            except BaseException:
                self.last_step = before  # what is on disk now
                raise

    def close(self) -> None:
        """Wait for a write in flight (its error goes to the log: one on its way out is the one to show), end the writer."""
        try:
            self.wait()
        except Exception as err:
            log.warning("the checkpoint being written when the run ended failed: %s", one_line(err))
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            self._memory.release()

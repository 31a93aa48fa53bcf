"""The training loop: the tutorial's loop, plus logging, evaluation, checkpoints and resume.

A run is setup (setup.py: typed components) -> train -> save -> cleanup, as `Trainer.fit` calls them.
Per step: fetch a batch (data_time), forward_backward + engine.step + scaler.update (step_time).
The optimizer step, the LR schedule and zero_grad run inside the step function (step_fn.py), on
the engine's optimizer thread. Evaluations and checkpoints synchronize the engine first, which also
makes the next step use fresh weights; they happen at steps fixed by the config, so a run resumed
from a checkpoint follows the same trajectory as one that ran straight through.

Under torchrun (dist.py) every rank runs this loop in lockstep on its shard of each global batch.
Rank 0 alone writes (metrics, reports, checkpoints) and evaluates; every rank synchronizes its
engine at the same steps, so all of them compute with the same weights.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import torch
from omegaconf import DictConfig
from rich.console import Console

from .console import ProgressBar, log, say
from .dist import Dist, peer_errors
from .errors import OutOfGpuMemory
from .export import export_run, exportable
from .kernels import CudnnSearch, cudnn_benchmark
from .lora import export_adapter, wants_adapter
from .meters import Meter
from .out_of_memory import out_of_gpu_memory
from .samples import write_samples
from .setup import Components, build_components
from .signals import SIGNALS, Interrupted, StopNow, StopRequest
from .tasks import StepResult
from .validate import local_batch


class Every(NamedTuple):
    """The trainer.* values the loop reads every step, read from the config once: an OmegaConf
    lookup costs ~25 µs of the issuing thread, during which the GPU waits for its next step."""

    log: int
    eval: Optional[int]
    checkpoint: Optional[int]
    async_step: bool
    evaluates: bool  # an eval set or sample prompts: there is something to evaluate


def freeze_setup_objects() -> None:
    """Collect once, then leave every object that exists now (torch's modules, the model, the configs) out of
    later collections. A full collection walks every tracked object: 115 ms over the 243k objects the CLI
    imports on the 2-core dev machine; a tiny 6-epoch CLI run there had eight of them, 12-236 ms each, and
    the one inside epoch 6 doubled its time (0.49 s, against 0.23-0.27 s). On the H200 an epoch of the main
    job is 1.6 s, so one such pause is a few percent of it. The Trainer's cleanup unfreezes them."""
    gc.collect()  # the setup's cyclic garbage (a model's temporary copies) is freed, not kept for the whole run
    gc.freeze()


class Trainer:
    def __init__(
        self, cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console, resume_hint: str, dist: Optional[Dist] = None,
        on_record: Optional[Callable[[dict], None]] = None,  # each metrics record, for the experiment trackers (loggers.py)
    ) -> None:
        self.cfg, self.run_dir, self.overrides = cfg, Path(run_dir), list(overrides)
        self.on_record = on_record
        self.console, self.resume_hint = console, resume_hint
        self.dist = dist or Dist()
        self.c: Optional[Components] = None
        self.unstepped: Optional[dict] = None  # the data's position before a batch whose step is not counted yet (_epoch)
        self.cudnn = CudnnSearch(cfg.engine.cudnn_benchmark, local_batch(cfg))  # which shapes cuDNN searches algorithms for (kernels.py)

    def fit(self, stop: StopRequest) -> dict:
        """Train to the end, or until `stop` is set (then checkpoint and raise Interrupted)."""
        threads_before = threading.active_count()
        try:
            c = self.setup()
            engine_ref = weakref.ref(c.engine)
            freeze_setup_objects()
            with cudnn_benchmark(self.cfg.engine.cudnn_benchmark):
                self.train(stop)
            try:
                self.save()
            except StopNow as now:  # during the final evaluation's files or the export: the checkpoint is what counts
                raise self._stopped_now(now.request) from None
            summary = c.report.summary(c.progress, self.cfg, self.overrides, c.checkpoints.fingerprint["params"], c.checkpoints.path, c.resume)
            del c
        except BaseException as err:
            # the user's to fix: one line with what to lower (read before the cleanup lets go of the run's parts)
            oom = self._out_of_memory(err) if isinstance(err, torch.OutOfMemoryError) else None
            self._cleanup_after_error()
            if oom is not None:
                raise oom from None
            raise
        self.cleanup()
        # Sweeps run every job in this process: the next job must start from a clean slate.
        summary["threads_before"], summary["threads_after"] = threads_before, threading.active_count()
        summary["engine_released"] = engine_ref() is None
        return summary

    def _out_of_memory(self, err: torch.OutOfMemoryError) -> OutOfGpuMemory:
        c = self.c
        step, kept = (c.progress.step, c.checkpoints.kept()) if c is not None else (None, "no checkpoint was written yet")
        return out_of_gpu_memory(err, self.cfg, step, kept, self._gpus())

    def _gpus(self) -> int:
        """The GPUs this process computes on."""
        return len(self.c.engine.devices) if self.c is not None else torch.cuda.device_count()

    def setup(self) -> Components:
        self.c = build_components(self.cfg, self.run_dir, self.overrides, self.console, self.dist, self.on_record)
        return self.c

    def save(self) -> None:
        """The checkpoint of the last step (when the schedule did not write it), the reports and the exports."""
        c, cfg, main = self.c, self.cfg, self.dist.main
        if c.checkpoints.last_step != c.progress.step:  # not the file's existence: every rank must decide the same
            self._checkpoint()
        c.checkpoints.wait()  # the summary names the newest checkpoint: it is on disk
        c.report.write_files()
        if main and cfg.trainer.hf_export and wants_adapter(cfg):
            folder = export_adapter(cfg, c.engine.model, c.engine.state_dict(), self.run_dir)
            if c.data.template is not None:  # the template trained with, beside the adapters (rptrain-generate reads it)
                (folder / "chat_template.jinja").write_text(c.data.template.source, encoding="utf-8")
            say(self.console, f"LoRA adapters (PEFT format): {folder}")
        elif main and cfg.trainer.hf_export and exportable(cfg):
            say(self.console, f"Hugging Face folder: {export_run(cfg, c.engine, self.run_dir, c.dtype)}")

    def cleanup(self) -> None:
        """Close the metrics file and the engine, also after an error; drop every reference to them."""
        c, self.c = self.c, None
        try:
            if c is not None:
                c.close()
        finally:
            del c
            gc.unfreeze()  # this run's objects may go now (a sweep runs its next job in this process)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _cleanup_after_error(self) -> None:
        """Cleanup while an error is on its way out: a second error here must not replace the first,
        which is what the user has to see (it goes to the log instead)."""
        try:
            self.cleanup()
        except Exception as err:
            log.warning("closing the run after its error failed too: %r", err)

    # ----------------------------------------------------------------------------- the loop
    def train(self, stop: StopRequest) -> None:
        c, p, t = self.c, self.c.progress, self.cfg.trainer
        self.every = Every(t.log_interval, t.eval_interval, t.checkpoint_interval, t.async_step, c.data.eval is not None or bool(c.sampler))
        if p.step >= c.total_steps:
            say(self.console, f"the checkpoint is already at step {p.step} of {c.total_steps}: nothing left to train")
        epoch, batch_index = c.data.train.position()
        try:
            with ProgressBar(self.console, t.progress if self.dist.main else False) as bar:
                c.engine.train()
                while p.step < c.total_steps and epoch < c.num_epochs:
                    if batch_index == 0:
                        p.epoch_meter = Meter()
                    bar.start_epoch(f"Epoch {epoch + 1}/{c.num_epochs}", len(c.data.train), batch_index)
                    batches = c.data.train.epoch(epoch, batch_index)
                    try:
                        self._epoch(epoch, batches, bar, stop)
                    finally:
                        batches.close()
                    epoch, batch_index = c.data.train.position()
            c.steps.check(c.engine)  # the last steps' checks may have run on the optimizer thread: wait for them
            if p.last_eval_step != p.step and self.every.evaluates:
                self._evaluate(epoch)
        except StopNow as now:  # a signal outside a step (waiting for a batch, evaluating): stop within seconds
            raise self._stopped_now(now.request) from None

    def _stopped_now(self, stop: StopRequest) -> Interrupted:
        """The checkpoint of the last finished step, unless it has one already (or there is none), then Interrupted."""
        c, p = self.c, self.c.progress
        if self.unstepped is not None:
            c.data.train.load_state_dict(self.unstepped)
            self.unstepped = None
        if p.step > 0 and c.checkpoints.last_step != p.step:
            self._checkpoint()
        c.checkpoints.wait()
        if p.step > 0:
            c.report.write_files(plot=False)
        return Interrupted(stop, p.step, str(c.checkpoints.path) if c.checkpoints.last_step >= 0 else "")

    def _epoch(self, epoch: int, batches: Iterator[tuple], bar: ProgressBar, stop: StopRequest) -> None:
        c, p, every = self.c, self.c.progress, self.every
        while p.step < c.total_steps:
            t0 = time.perf_counter()
            # A StopNow between taking the batch and counting its step (before the window below) puts the
            # data back (_stopped_now): else the checkpoint skipped that batch, or held the step's weights
            # under the step before it, and the resumed run differed (issue 31's campaign).
            self.unstepped = c.data.train.state_dict()
            batch = next(batches, None)
            if batch is None:
                return
            t1 = time.perf_counter()
            # A signal now: this step ends, is counted and logged, then a checkpoint. (Logged inside: a signal
            # between the count and the log stopped the run with the step in its checkpoint but not in
            # metrics.jsonl, test_cli_resume's pre-emption test, 2026-12-06.)
            with stop.deferred():
                stopping, scale, result, skipped = self._step(batch, stop)
                c.report.add_step(p, result, t1 - t0, time.perf_counter() - t1, skipped)
                self.unstepped = None
                logged = p.step % every.log == 0 or p.step == c.total_steps
                bar.advance(c.report.bar_stats, logged)  # off a terminal, a heartbeat line reads them
                if logged:
                    c.report.log_step(p, epoch, c.steps.lr(p.step - 1), scale, bar)
            # One process: a signal during the step stops after it. Several: after the step all agreed on.
            self._after_step(epoch, c.data.train.next_batch >= len(c.data.train), stop, bool(stop) if self.dist.world == 1 else stopping)

    def _step(self, batch: tuple, stop: StopRequest) -> tuple[bool, float, StepResult, bool]:
        """One training step: (whether every rank stops after it, the loss scale it ran with, its StepResult, whether it was skipped)."""
        c, d, step = self.c, self.dist, self.c.progress.step + 1
        total, stopping = self._exchange(c.task.count(batch), stop) if d.world > 1 else (None, False)
        scale = c.scaler.get_scale()
        self.cudnn.training(batch)
        with peer_errors("gradient averaging", d.world > 1):
            result = c.task.train_step(c.engine, batch, c.scaler, total)
        step_fn, skipped = c.steps.for_step(result.loss, step)
        c.engine.step(step_fn, is_async=self.every.async_step)
        c.scaler.update()
        c.steps.check()  # a step already skipped its update on the optimizer thread: stop now
        if skipped:  # left out of the logged means
            say(self.console, f"step {step}: the loss is not finite: this step's update is skipped (trainer.on_nonfinite=skip)")
        return stopping, scale, result, skipped

    def _exchange(self, count: int, stop: StopRequest) -> tuple[int, bool]:
        """One small all_reduce per step, before it: the loss count over all ranks (the loss
        divisor) and whether any rank has been signalled; then all of them stop after this step."""
        flags = [float(stop.signum == s) for s in SIGNALS]
        sums = self.dist.sum([float(count), *flags], "the exchange of loss counts and stop requests")
        signum = next((s for s, n in zip(SIGNALS, sums[1:]) if n > 0), None)
        if signum is not None and not stop:
            stop.set(signum)  # another rank was signalled first; this one's own signal is then a duplicate
        return int(round(sums[0])), signum is not None

    def _after_step(self, epoch: int, epoch_done: bool, stop: StopRequest, stopping: bool) -> None:
        c, p, every = self.c, self.c.progress, self.every
        last = p.step >= c.total_steps
        # trainer.eval_interval set: every that many steps (and at the end), not at every epoch's end too
        # (a small chat set has epochs of a step or two); null: at the end of every epoch. Not once a stop is asked for.
        if not stopping and every.evaluates and (last or (p.step % every.eval == 0 if every.eval else epoch_done)):
            self._evaluate(epoch)
        if epoch_done:
            c.report.end_epoch(p, epoch)
        interval = every.checkpoint
        if stopping or last or (p.step % interval == 0 if interval else epoch_done):
            with stop.deferred(then_stop=not stopping):  # a checkpoint write is finished, not cut short
                self._checkpoint(background=not (stopping or last))
        if stopping:
            c.report.write_files(plot=False)
            raise Interrupted(stop, p.step, str(c.checkpoints.path))

    def _evaluate(self, epoch: int) -> None:
        c, p, start = self.c, self.c.progress, time.perf_counter()
        c.engine.synchronize()  # evaluate the newest weights, as the tutorial does (every rank: same weights)
        p.last_eval_step = p.step
        if not self.dist.main:  # rank 0 evaluates the whole eval set; the others wait at the next step
            return
        self.cudnn.evaluating()
        c.engine.eval()
        with torch.no_grad():
            result = c.task.evaluate(c.engine, c.data.eval.epoch(0)) if c.data.eval is not None else None
            if c.sampler:
                write_samples(c.engine, c.sampler, p.step, self.run_dir, lambda line: say(self.console, line))
        c.engine.train()
        if result is not None:
            c.report.evaluated(p, epoch, result, time.perf_counter() - start)

    def _checkpoint(self, background: bool = False) -> None:
        c = self.c
        c.checkpoints.save(c.progress, c.engine, c.optimizer, c.scheduler, c.scaler, c.data, c.metrics, background)

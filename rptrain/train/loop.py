"""The training loop: the tutorial's loop, plus logging, evaluation, checkpoints and resume.

Per step: fetch a batch (data_time), forward_backward + model.step + scaler.update (step_time).
The optimizer step, the LR schedule and zero_grad run inside the step function, on the engine's
optimizer thread. Evaluations and checkpoints synchronize the engine first, which also makes the
next step use fresh weights; they happen at steps fixed by the config, so a run resumed from a
checkpoint follows the same trajectory as one that ran straight through.
"""
from __future__ import annotations

import gc
import math
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from rptrain import OptimizerCtx, RoundPipe

from .checkpoint import LAST, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .console import ProgressBar, epoch_line, log, say, step_line
from .data import TrainData, build_data
from .errors import CheckpointError, one_line
from .meters import Meter, RunProgress, progress_from, progress_state
from .metrics import MetricsLog
from .model import IMAGE, build_model, fingerprint
from .plots import plot_curves
from .precision import build_scaler, torch_dtype
from .resume import check_resume_state, resolve_resume
from .run_config import build_run_config
from .signals import Interrupted, StopRequest
from .tasks import make_task
from .validate import check_vocab, num_microbatch, validate_config


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console, resume_hint: str) -> None:
        self.cfg, self.run_dir, self.overrides = cfg, Path(run_dir), list(overrides)
        self.console, self.resume_hint = console, resume_hint
        self.checkpoint_path = self.run_dir / "checkpoints" / LAST

    # ----------------------------------------------------------------------------- setup
    def fit(self, stop: StopRequest) -> dict:
        """Train to the end, or until `stop` is set (then checkpoint and raise Interrupted)."""
        cfg = self.cfg
        self.stop = stop
        validate_config(cfg)
        threads_before = threading.active_count()
        dtype = torch_dtype(cfg.precision.compute_dtype)
        torch.manual_seed(cfg.trainer.seed)
        data = build_data(cfg, dtype)
        check_vocab(cfg, data.vocab_size)
        model = build_model(cfg, dtype, vocab_size=data.vocab_size)
        self.fingerprint = fingerprint(cfg.model.name, model)
        resume = resolve_resume(cfg.trainer.resume, Path(cfg.output_root), self.run_dir, self.overrides)
        if cfg.trainer.resume == "auto" and resume is None:
            say(self.console, f"trainer.resume=auto: no checkpoint of a run with these overrides under {cfg.output_root}: starting fresh")
        state = load_checkpoint(resume, self.fingerprint) if resume else None
        if state is not None:
            check_resume_state(resume, state, cfg)
        say(self.console, f"model {cfg.model.name}: {self.fingerprint['params']:,} parameters, compute {dtype}; data {data.description}")
        engine = RoundPipe(model, torch_dtype(cfg.precision.optim_dtype), build_run_config(cfg.run_config, len(model)))
        engine_ref = weakref.ref(engine)
        del model  # the engine owns the weights now
        # Handed over in a list that _fit empties: a big checkpoint should not stay mapped all run.
        handover = [state]
        del state
        try:
            summary = self._fit(engine, data, dtype, handover, resume)
        finally:
            self.parts = {}  # the only other references to the engine, optimizer and data: free them for the next job
            engine.close()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        # Sweeps run every job in this process: the next job must start from a clean slate.
        summary["threads_before"], summary["threads_after"] = threads_before, threading.active_count()
        summary["engine_released"] = engine_ref() is None
        return summary

    def _fit(self, engine: RoundPipe, data: TrainData, dtype: torch.dtype, handover: list, resume: Optional[Path]) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        steps_per_epoch = len(data.train)
        self.total_steps = t.max_steps or t.epochs * steps_per_epoch
        self.num_epochs = math.ceil(self.total_steps / steps_per_epoch)
        with OptimizerCtx():
            optimizer = instantiate(cfg.optim.optimizer, params=engine.parameters(), _convert_="all")
        scheduler = instantiate(cfg.optim.schedule, optimizer=optimizer, total_steps=self.total_steps)
        scaler = build_scaler(cfg.precision)
        state = handover.pop()
        progress = RunProgress()
        if state is not None:
            progress = self._restore(state, resume, engine, optimizer, scheduler, scaler, data)
        self.metrics = MetricsLog(self.run_dir, state["history"] if state else None)
        del state
        self.task = make_task(data.kind, num_microbatch(cfg), dtype)
        self.parts = dict(engine=engine, optimizer=optimizer, scheduler=scheduler, scaler=scaler, data=data)
        try:
            self._loop(progress)
        finally:
            self.metrics.close()
        return self._summary(progress, resume)

    def _restore(self, state: dict, path: Path, engine, optimizer, scheduler, scaler, data: TrainData) -> RunProgress:
        try:
            engine.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler.is_enabled() and state["scaler"]:  # fp16 -> bf16/fp32 (or back) keeps no scale
                scaler.load_state_dict(state["scaler"])
            data.train.load_state_dict(state["loader"])
            progress = progress_from(state["progress"])
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise CheckpointError(f"checkpoint {path} does not fit this run ({one_line(err)[:300]}): resume with the config it was written with") from err
        set_rng_state(state["rng"])
        say(self.console, f"resumed from {path} at step {progress.step}")
        return progress

    # ----------------------------------------------------------------------------- the loop
    def _loop(self, p: RunProgress) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        engine, scaler, data = self.parts["engine"], self.parts["scaler"], self.parts["data"]
        optimizer, scheduler = self.parts["optimizer"], self.parts["scheduler"]
        lr_of = lambda step: scheduler.base_lrs[0] * scheduler.lr_lambdas[0](step)  # noqa: E731  (no race with the optimizer thread)
        clip = cfg.optim.clip_grad_norm
        # GradScaler skips the optimizer step when fp16 gradients overflow, by design; the schedule
        # still advances (as in torch's AMP recipes), which torch would warn about on every skip.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")

        def step_fn() -> None:  # runs on the optimizer thread
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_([q for g in optimizer.param_groups for q in g["params"]], clip)
            scaler.step(optimizer)
            optimizer.zero_grad()
            scheduler.step()

        window = Meter()
        epoch, batch_index = data.train.position()
        if p.step >= self.total_steps:
            say(self.console, f"the checkpoint is already at step {p.step} of {self.total_steps}: nothing left to train")
        stop = self.stop
        with ProgressBar(self.console, t.progress) as bar:
            engine.train()
            while p.step < self.total_steps and epoch < self.num_epochs:
                if batch_index == 0:
                    p.epoch_meter = Meter()
                batches = data.train.epoch(epoch, batch_index)
                bar.start_epoch(f"Epoch {epoch + 1}/{self.num_epochs}", len(data.train), batch_index)
                while p.step < self.total_steps:
                    t0 = time.perf_counter()
                    batch = next(batches, None)
                    if batch is None:
                        break
                    t1 = time.perf_counter()
                    scale = scaler.get_scale()
                    result = self.task.train_step(engine, batch, scaler)
                    engine.step(step_fn, is_async=t.async_step)
                    scaler.update()
                    t2 = time.perf_counter()
                    p.step += 1
                    for meter in (window, p.epoch_meter):
                        meter.add(result, t1 - t0, t2 - t1)
                    p.train_seconds += t2 - t0
                    p.samples += result.samples
                    p.tokens += result.count if data.kind != IMAGE else 0
                    bar.advance(self._bar_stats(window))
                    if p.step % t.log_interval == 0 or p.step == self.total_steps:
                        self._log_train(p, window, epoch, lr_of(p.step - 1), scale, bar.enabled)
                        window = Meter()
                    self._after_step(p, epoch, data.train.next_batch >= len(data.train), stop)
                batches.close()
                epoch, batch_index = data.train.position()
        if p.last_eval_step != p.step and data.eval is not None:
            self._evaluate(p, epoch)
        if not self.checkpoint_path.is_file() or self._ckpt_step != p.step:
            self._checkpoint(p)
        self._write_reports()

    def _after_step(self, p: RunProgress, epoch: int, epoch_done: bool, stop: StopRequest) -> None:
        t, data = self.cfg.trainer, self.parts["data"]
        last = p.step >= self.total_steps
        if data.eval is not None and (epoch_done or last or (t.eval_interval and p.step % t.eval_interval == 0)):
            self._evaluate(p, epoch)
        if epoch_done:
            self._end_epoch(p, epoch)
        interval = t.checkpoint_interval
        if stop or last or (p.step % interval == 0 if interval else epoch_done):
            self._checkpoint(p)
        if stop:
            self._write_reports()
            raise Interrupted(stop, p.step, str(self.checkpoint_path))

    # ----------------------------------------------------------------------------- logging
    def _bar_stats(self, window: Meter) -> str:
        rate = window.samples / max(window.seconds(), 1e-9)
        return f"loss {window.mean_loss():.4f}  {rate:,.0f} samples/s"

    def _log_train(self, p: RunProgress, w: Meter, epoch: int, lr: float, scale: float, bar_on: bool) -> None:
        metric = self.task.metric
        seconds = max(w.seconds(), 1e-9)
        values: dict[str, Any] = dict(
            step=p.step, epoch=epoch + 1, loss=w.mean_loss(), lr=lr, loss_scale=scale,
            samples_per_s=w.samples / seconds, data_time=w.data_time / w.steps, step_time=w.step_time / w.steps,
        )
        values[metric] = w.metric(metric)
        if metric == "ppl":
            values["tokens_per_s"] = w.count / seconds
        record = self.metrics.add("train", **values, time=p.train_seconds)
        line = step_line(record, self.total_steps, metric, "tokens" if metric == "ppl" else "samples")
        if bar_on:  # the bar shows it live; the log file keeps it
            log.info(line)
        else:
            say(self.console, line)

    def _evaluate(self, p: RunProgress, epoch: int) -> None:
        engine, loader = self.parts["engine"], self.parts["data"].eval
        engine.synchronize()  # evaluate the newest weights, as the tutorial does
        engine.eval()
        with torch.no_grad():
            result = self.task.evaluate(engine, loader.epoch(0))
        engine.train()
        p.last_eval, p.last_eval_step = result, p.step
        self.metrics.add("eval", step=p.step, epoch=epoch + 1, **result, time=p.train_seconds)

    def _end_epoch(self, p: RunProgress, epoch: int) -> None:
        metric, m = self.task.metric, p.epoch_meter
        record = {
            "step": p.step, "epoch": epoch + 1, "train_loss": m.mean_loss(), f"train_{metric}": m.metric(metric),
            "epoch_time": m.seconds(), "samples_per_s": m.samples / max(m.seconds(), 1e-9),
        }
        if p.last_eval_step == p.step:
            record.update({f"test_{k}": v for k, v in p.last_eval.items()})
        self.metrics.add("epoch", **record, time=p.train_seconds)
        say(self.console, epoch_line(epoch + 1, self.num_epochs, record, metric))
        self._write_reports()

    def _write_reports(self) -> None:
        self.metrics.write_csv()
        plot_curves(self.metrics.records, self.run_dir / "curves.png", self.task.metric)

    # ----------------------------------------------------------------------------- checkpoints
    _ckpt_step = -1

    def _checkpoint(self, p: RunProgress) -> None:
        engine = self.parts["engine"]
        engine.synchronize()  # the master weights after this step, and no step in flight
        parts = self.parts
        save_checkpoint(self.checkpoint_path, {
            "fingerprint": self.fingerprint,
            "model": engine.state_dict(),
            "optimizer": parts["optimizer"].state_dict(),
            "scheduler": parts["scheduler"].state_dict(),  # our lambda is a closure: saved as None, rebuilt from the config
            "scaler": parts["scaler"].state_dict(),
            "loader": parts["data"].train.state_dict(),
            "rng": rng_state(),
            "progress": progress_state(p),
            "history": self.metrics.records,
            "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
            "overrides": self.overrides,
        })
        self._ckpt_step = p.step
        self.metrics.write_csv()

    def _summary(self, p: RunProgress, resume: Optional[Path]) -> dict:
        metric = self.task.metric
        m = p.epoch_meter
        final = {"train_loss": m.mean_loss(), f"train_{metric}": m.metric(metric)}
        final.update({f"test_{k}": v for k, v in p.last_eval.items()})
        seconds = max(p.train_seconds, 1e-9)
        summary = {
            "status": "completed",
            "model": self.cfg.model.name,
            "params": self.fingerprint["params"],
            "data": self.cfg.data.name,
            "steps": p.step,
            "epochs": len(self.metrics.of_kind("epoch")),
            "final": final,
            "samples_per_s": p.samples / seconds,
            "train_seconds": p.train_seconds,
            "overrides": self.overrides,
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.checkpoint_path),
            "resumed_from": str(resume) if resume else None,
        }
        if metric == "ppl":
            summary["tokens_per_s"] = p.tokens / seconds
        return summary

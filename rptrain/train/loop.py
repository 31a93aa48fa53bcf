"""The training loop: the tutorial's loop, plus logging, evaluation, checkpoints and resume.

Per step: fetch a batch (data_time), forward_backward + model.step + scaler.update (step_time).
The optimizer step, the LR schedule and zero_grad run inside the step function, on the engine's
optimizer thread. Evaluations and checkpoints synchronize the engine first, which also makes the
next step use fresh weights; they happen at steps fixed by the config, so a run resumed from a
checkpoint follows the same trajectory as one that ran straight through.

Under torchrun (dist.py) every rank runs this loop in lockstep on its shard of each global batch.
Rank 0 alone writes (metrics, reports, checkpoints) and evaluates; every rank synchronizes its
engine at the same steps, so all of them compute with the same weights.
"""
from __future__ import annotations

import copy
import gc
import math
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from rptrain import OptimizerCtx, RoundPipe

from .checkpoint import LAST, load_checkpoint, rng_state, save_rotating, set_rng_state
from .console import ProgressBar, epoch_line, epoch_rate_line, log, say, step_line
from .data import TrainData, build_data
from .dist import Dist, FailedOnRankZero, inject_fault, peer_errors
from .errors import CheckpointError, NonFiniteLoss, one_line
from .export import export_run, exportable
from .kernels import cudnn_benchmark
from .lora import export_adapter, wants_adapter
from .memory_format import choose_memory_format
from .meters import Meter, RunProgress, epoch_rate, progress_from, progress_state, rank_share
from .metrics import MetricsLog
from .model import IMAGE, build_model, fingerprint
from .plots import plot_curves
from .precision import build_scaler, torch_dtype
from .resume import check_resume_state, loader_state_for, resolve_resume
from .run_config import build_run_config
from .samples import make_sampler, write_samples
from .signals import SIGNALS, Interrupted, StopRequest
from .tasks import StepResult, make_task
from .validate import check_vocab, num_microbatch, validate_config


class Trainer:
    def __init__(
        self, cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console, resume_hint: str, dist: Optional[Dist] = None,
        on_record: Optional[Callable[[dict], None]] = None,  # each metrics record, for the experiment trackers (loggers.py)
    ) -> None:
        self.cfg, self.run_dir, self.overrides = cfg, Path(run_dir), list(overrides)
        self.on_record = on_record
        self.console, self.resume_hint = console, resume_hint
        self.dist = dist or Dist()
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
        resume = self._resolve_resume()
        if cfg.trainer.resume == "auto" and resume is None:
            say(self.console, f"trainer.resume=auto: no checkpoint of a run with these overrides under {cfg.output_root}: starting fresh")
        state = load_checkpoint(resume, self.fingerprint) if resume else None
        if state is not None:
            check_resume_state(resume, state, cfg)
        d = self.dist
        b = cfg.trainer.batch_size
        ranks = f"; global batch {b} = {d.world} ranks x {b // d.world}" if d.world > 1 else ""
        say(self.console, f"model {cfg.model.name}: {self.fingerprint['params']:,} parameters, compute {dtype}; data {data.description}{ranks}")
        with peer_errors("the comparison of the ranks' initial weights", d.world > 1):
            engine = RoundPipe(model, torch_dtype(cfg.precision.optim_dtype), build_run_config(cfg.run_config, len(model)),
                               devices=d.devices, process_group=d.group, cuda_graphs=cfg.engine.cuda_graphs,
                               optimizer_threads=cfg.engine.optimizer_threads,
                               max_host_memory=cfg.engine.max_host_memory, max_gpu_memory=cfg.engine.max_gpu_memory,
                               memory_format=choose_memory_format(cfg.engine.channels_last, model, d.devices))
        engine_ref = weakref.ref(engine)
        log.info("engine host memory: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in engine.memory_report().items()))
        del model  # the engine owns the weights now
        # Handed over in a list that _fit empties: a big checkpoint should not stay mapped all run.
        handover = [state]
        del state
        try:
            with cudnn_benchmark(cfg.engine.cudnn_benchmark):
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

    def _resolve_resume(self) -> Optional[Path]:
        """Rank 0 picks the checkpoint and every rank loads that file (trainer.resume=auto on each
        rank could see a newer file appear, or another filesystem)."""
        cfg, d = self.cfg, self.dist
        found, error = None, None
        if d.main:
            try:
                choice = resolve_resume(cfg.trainer.resume, Path(cfg.output_root), self.run_dir, self.overrides)
                found = choice.path
                if choice.note():
                    say(self.console, choice.note())
            except CheckpointError as err:
                if d.world == 1:
                    raise
                error = err
        path, message = d.broadcast((str(found) if found else None, str(error) if error else None), "the choice of a checkpoint to resume from")
        if error is not None:
            raise error
        if message is not None:
            raise FailedOnRankZero(message)
        return Path(path) if path else None

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
            progress = rank_share(self._restore(state, resume, engine, optimizer, scheduler, scaler, data), self.dist.main)
            self._ckpt_step = progress.step  # the checkpoint it resumed from is the last one there is
        self.metrics = MetricsLog(self.run_dir if self.dist.main else None, state["history"] if state else None, self.on_record)
        del state
        self.task = make_task(data.kind, num_microbatch(cfg), dtype, self.dist.world)
        self.sampler = make_sampler(cfg, data)  # every rank: evaluations (and their synchronizations) happen at the same steps
        self._param_names = {name for name, _ in engine.named_parameters()}  # BatchNorm buffers differ across ranks
        self.parts = dict(engine=engine, optimizer=optimizer, scheduler=scheduler, scaler=scaler, data=data)
        try:
            self._loop(progress)
        finally:
            self.metrics.close()
        if self.dist.main and cfg.trainer.hf_export and wants_adapter(cfg):
            say(self.console, f"LoRA adapters (PEFT format): {export_adapter(cfg, engine.model, engine.state_dict(), self.run_dir)}")
        elif self.dist.main and cfg.trainer.hf_export and exportable(cfg):
            say(self.console, f"Hugging Face folder: {export_run(cfg, engine.state_dict(), self.run_dir, dtype)}")
        return self._summary(progress, resume)

    def _restore(self, state: dict, path: Path, engine, optimizer, scheduler, scaler, data: TrainData) -> RunProgress:
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

        params = [q for g in optimizer.param_groups for q in g["params"]]
        # Without a GradScaler, non-finite values are ours to catch: the loss below, and with
        # on_nonfinite=skip also gradients that overflowed under a finite loss (averaged over the
        # ranks, so every rank decides the same).
        guard = not scaler.is_enabled()
        skip = guard and t.on_nonfinite.value == "skip"
        # on_nonfinite=skip (its logged means leave the step out) and several ranks (they must agree) read
        # the loss here, one wait for the device a step. The default, stop, with one process lets the step
        # function look at it on the optimizer thread instead, so the loop never waits for the device.
        check_here = guard and (skip or self.dist.world > 1)
        nonfinite_steps: list[int] = []  # filled by finite_step on the optimizer thread

        def skip_fn() -> None:  # a step without the update; the schedule advances, as GradScaler's skips do
            optimizer.zero_grad()
            scheduler.step()

        def step_fn() -> None:  # runs on the optimizer thread
            if skip and not all(bool(torch.isfinite(q.grad).all()) for q in params if q.grad is not None):
                return skip_fn()
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, clip)
            scaler.step(optimizer)
            optimizer.zero_grad()
            scheduler.step()

        def finite_step(loss: torch.Tensor, step: int) -> Callable[[], None]:
            def run() -> None:  # on the optimizer thread: the update never sees a non-finite loss
                if not bool(torch.isfinite(loss).all()):
                    nonfinite_steps.append(step)
                    return skip_fn()
                step_fn()
            return run

        window, window_skipped = Meter(), 0
        epoch, batch_index = data.train.position()
        if p.step >= self.total_steps:
            say(self.console, f"the checkpoint is already at step {p.step} of {self.total_steps}: nothing left to train")
        stop, d = self.stop, self.dist
        with ProgressBar(self.console, t.progress if d.main else False) as bar:
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
                    total, stopping = self._exchange(self.task.count(batch), stop) if d.world > 1 else (None, None)
                    inject_fault(d, p.step + 1, stop)  # tests only; a no-op unless RPTRAIN_TEST_* is set
                    scale = scaler.get_scale()
                    with peer_errors("gradient averaging", d.world > 1):
                        result = self.task.train_step(engine, batch, scaler, total)
                    nonfinite = check_here and self._nonfinite(result.loss, p.step + 1, stop_on_it=not skip)
                    checked_there = guard and not check_here
                    engine.step(skip_fn if nonfinite else finite_step(result.loss, p.step + 1) if checked_there else step_fn,
                                is_async=t.async_step)
                    scaler.update()
                    if nonfinite_steps:  # a step already skipped its update on the optimizer thread: stop now
                        raise NonFiniteLoss(self._nonfinite_message(nonfinite_steps[0]))
                    if nonfinite:  # left out of the logged means
                        say(self.console, f"step {p.step + 1}: the loss is not finite: this step's update is skipped (trainer.on_nonfinite=skip)")
                        result, window_skipped = StepResult(result.loss.new_zeros(()), 0.0, 0, [], result.samples), window_skipped + 1
                    t2 = time.perf_counter()
                    p.step += 1
                    for meter in (window, p.epoch_meter):
                        meter.add(result, t1 - t0, t2 - t1)
                    p.train_seconds += t2 - t0
                    p.samples += result.samples
                    p.tokens += result.count if data.kind != IMAGE else 0
                    logged = p.step % t.log_interval == 0 or p.step == self.total_steps
                    bar.advance(lambda: self._bar_stats(window), logged)  # off a terminal, a heartbeat line reads them
                    if logged:  # the only reads of the step's numbers
                        if window.steps > window_skipped:  # skipped steps alone have no loss to log
                            bar.show(self._bar_stats(window))
                            self._log_train(p, window, epoch, lr_of(p.step - 1), scale, bar.enabled)
                        window, window_skipped = Meter(), 0
                    # One process: a signal during the step stops after it. Several: after the step all agreed on.
                    self._after_step(p, epoch, data.train.next_batch >= len(data.train), stop, bool(stop) if d.world == 1 else stopping)
                batches.close()
                epoch, batch_index = data.train.position()
        if guard and not check_here:  # the last steps' checks ran on the optimizer thread: wait for them
            engine.synchronize()
            if nonfinite_steps:
                raise NonFiniteLoss(self._nonfinite_message(nonfinite_steps[0]))
        if p.last_eval_step != p.step and (data.eval is not None or self.sampler):
            self._evaluate(p, epoch)
        if self._ckpt_step != p.step:  # not the file's existence: every rank must decide the same
            self._checkpoint(p)
        self._write_reports()

    def _nonfinite(self, loss: torch.Tensor, step: int, stop_on_it: bool) -> bool:
        """Whether this step's loss is NaN/inf on any rank (then every rank skips or stops alike)."""
        bad = float(not bool(torch.isfinite(loss)))
        if self.dist.world > 1:
            bad = self.dist.sum([bad], "the check for a non-finite loss")[0]
        if bad and stop_on_it:  # before the step: the update never happens, the last checkpoint stays the last
            raise NonFiniteLoss(self._nonfinite_message(step))
        return bad > 0

    def _nonfinite_message(self, step: int) -> str:
        kept = f"the last checkpoint (step {self._ckpt_step}, {self.checkpoint_path}) is kept" if self._ckpt_step >= 0 else "no checkpoint was written yet"
        return (
            f"the training loss is not finite (NaN or inf) at step {step} (without a GradScaler nothing skips it): the weights were not "
            f"updated with it and {kept}; lower optim.optimizer.lr, set optim.clip_grad_norm, or let such steps be skipped with trainer.on_nonfinite=skip"
        )

    def _exchange(self, count: int, stop: StopRequest) -> tuple[int, bool]:
        """One small all_reduce per step, before it: the loss count over all ranks (the loss
        divisor) and whether any rank has been signalled; then all of them stop after this step."""
        flags = [float(stop.signum == s) for s in SIGNALS]
        sums = self.dist.sum([float(count), *flags], "the exchange of loss counts and stop requests")
        signum = next((s for s, n in zip(SIGNALS, sums[1:]) if n > 0), None)
        if signum is not None and not stop:
            stop.set(signum)  # another rank was signalled first; this one's own signal is then a duplicate
        return int(round(sums[0])), signum is not None

    def _after_step(self, p: RunProgress, epoch: int, epoch_done: bool, stop: StopRequest, stopping: bool) -> None:
        t, data = self.cfg.trainer, self.parts["data"]
        last = p.step >= self.total_steps
        if (data.eval is not None or self.sampler) and (epoch_done or last or (t.eval_interval and p.step % t.eval_interval == 0)):
            self._evaluate(p, epoch)
        if epoch_done:
            self._end_epoch(p, epoch)
        interval = t.checkpoint_interval
        if stopping or last or (p.step % interval == 0 if interval else epoch_done):
            self._checkpoint(p)
        if stopping:
            self._write_reports()
            raise Interrupted(stop, p.step, str(self.checkpoint_path))

    # ----------------------------------------------------------------------------- logging
    def _bar_stats(self, window: Meter) -> str:
        lm = self.task.metric == "ppl"  # a language model's throughput is in tokens
        rate = (window.count if lm else window.samples) / max(window.seconds(), 1e-9)
        return f"loss {window.mean_loss():.4f}  {rate:,.0f} {'tokens' if lm else 'samples'}/s"

    def _global(self, m: Meter) -> Meter:
        """A meter's sums over all ranks (counts added, times averaged): what the run as a whole did."""
        d = self.dist
        return m if d.world == 1 else Meter.from_sums(d.sum(m.sums(), "the averaging of logged metrics"), m.steps, d.world)

    def _log_train(self, p: RunProgress, w: Meter, epoch: int, lr: float, scale: float, bar_on: bool) -> None:
        metric = self.task.metric
        w = self._global(w)
        seconds = max(w.seconds(), 1e-9)
        values: dict[str, Any] = dict(
            step=p.step, epoch=epoch + 1, loss=w.mean_loss(), lr=lr, loss_scale=scale,
            samples_per_s=w.samples / seconds, data_time=w.data_time / w.steps, step_time=w.step_time / w.steps,
        )
        values[metric] = w.metric(metric)
        if metric == "ppl":
            values["tokens_per_s"] = w.count / seconds
        record = self.metrics.add("train", **values, time=p.train_seconds)
        if not self.dist.main:
            return
        line = step_line(record, self.total_steps, metric, "tokens" if metric == "ppl" else "samples")
        if bar_on:  # the bar shows it live; the log file keeps it
            log.info(line)
        else:
            say(self.console, line)

    def _evaluate(self, p: RunProgress, epoch: int) -> None:
        engine, loader = self.parts["engine"], self.parts["data"].eval
        engine.synchronize()  # evaluate the newest weights, as the tutorial does (every rank: same weights)
        p.last_eval_step = p.step
        if not self.dist.main:  # rank 0 evaluates the whole eval set; the others wait at the next step
            return
        engine.eval()
        with torch.no_grad():
            result = self.task.evaluate(engine, loader.epoch(0)) if loader is not None else None
            if self.sampler:
                write_samples(engine, self.sampler, p.step, self.run_dir, lambda line: say(self.console, line))
        engine.train()
        if result is not None:
            p.last_eval, p.last_eval_step = result, p.step
            self.metrics.add("eval", step=p.step, epoch=epoch + 1, **result, time=p.train_seconds)

    def _end_epoch(self, p: RunProgress, epoch: int) -> None:
        metric, m = self.task.metric, self._global(p.epoch_meter)
        record = {
            "step": p.step, "epoch": epoch + 1, "train_loss": m.mean_loss(), f"train_{metric}": m.metric(metric),
            "epoch_time": m.seconds(), "samples_per_s": m.samples / max(m.seconds(), 1e-9),
        }
        if p.last_eval_step == p.step:
            record.update({f"test_{k}": v for k, v in p.last_eval.items()})
        record.update(epoch_rate(p.epoch_meter, m.samples))
        self.metrics.add("epoch", **record, time=p.train_seconds)
        say(self.console, epoch_line(epoch + 1, self.num_epochs, record, metric))
        if record["epoch_samples_per_s"] is not None:
            say(self.console, epoch_rate_line(epoch + 1, self.num_epochs, record))
        self._write_reports()

    def _write_reports(self) -> None:
        if not self.dist.main:
            return
        self.metrics.write_csv()
        plot_curves(self.metrics.records, self.run_dir / "curves.png", self.task.metric)

    # ----------------------------------------------------------------------------- checkpoints
    _ckpt_step = -1

    def _checkpoint(self, p: RunProgress) -> None:
        engine = self.parts["engine"]
        engine.synchronize()  # the master weights after this step, and no step in flight (every rank: same weights)
        parts = self.parts
        self._ckpt_step = p.step
        total = self._global_progress(p)
        model_state = engine.state_dict()
        if self.dist.world > 1:  # cheap next to writing the file, and the one place a divergence would do harm
            self.dist.check_same({k: v for k, v in model_state.items() if k in self._param_names}, "weights")
            log.info(f"step {p.step}: the {self.dist.world} ranks hold identical weights")
        if not self.dist.main:
            return
        save_rotating(self.checkpoint_path.parent, {
            "fingerprint": self.fingerprint,
            "model": model_state,
            "optimizer": parts["optimizer"].state_dict(),
            "scheduler": parts["scheduler"].state_dict(),  # our lambda is a closure: saved as None, rebuilt from the config
            "scaler": parts["scaler"].state_dict(),
            "loader": parts["data"].train.state_dict(),
            "rng": rng_state(),
            "progress": progress_state(total),
            "history": self.metrics.records,
            "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
            "overrides": self.overrides,
        }, p.step, self.cfg.trainer.keep_checkpoints)
        self.metrics.write_csv()

    def _global_progress(self, p: RunProgress) -> RunProgress:
        """The run's progress summed over the ranks: what a checkpoint stores (see meters.rank_share)."""
        d = self.dist
        if d.world == 1:
            return p
        sums = d.sum([*p.epoch_meter.sums(), p.samples, p.tokens], "the summing of progress counters")
        total = copy.copy(p)
        total.epoch_meter = Meter.from_sums(sums[:6], p.epoch_meter.steps, d.world)
        total.samples, total.tokens = int(round(sums[6])), int(round(sums[7]))
        return total

    def _summary(self, p: RunProgress, resume: Optional[Path]) -> dict:
        metric = self.task.metric
        p = self._global_progress(p)
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
            "world_size": self.dist.world,
        }
        if metric == "ppl":
            summary["tokens_per_s"] = p.tokens / seconds
        return summary

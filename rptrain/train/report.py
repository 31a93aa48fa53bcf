"""What a run reports: the log lines and bar of the steps, the epoch lines, metrics.csv and
curves.png, and the summary at the end.

The steps' numbers stay tensors in a Meter until a log step reads them (meters.py). Under torchrun
every rank sums its meters with the others' at the same steps; rank 0 alone prints and writes.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from rptrain.models.moe import take_balance

from .console import ProgressBar, epoch_line, epoch_rate_line, log, say, step_line
from .dist import Dist
from .meters import Meter, RunProgress, epoch_rate, global_progress
from .metrics import MetricsLog
from .plots import plot_curves
from .tasks import StepResult, Task


# curves.png is redrawn at an epoch's end only when this long has passed since the last drawing, and always at the
# run's end: a drawing takes 0.11-0.26 s on the CI machine (0.46 s the first, importing matplotlib), against the
# main job's 1.8 s epochs on the H200 (2026-12-06), where one at each of 20 epochs cost the run several seconds.
PLOT_EVERY_S = 30.0


class Report:
    def __init__(self, console: Console, d: Dist, metrics: MetricsLog, task: Task, run_dir: Path, total_steps: int, num_epochs: int) -> None:
        self.console, self.dist, self.metrics, self.task = console, d, metrics, task
        self.run_dir, self.total_steps, self.num_epochs = Path(run_dir), total_steps, num_epochs
        self.window, self.window_skipped = Meter(), 0  # the steps since the last log step
        self.plotted_at: Optional[float] = None  # time.monotonic() of the last curves.png

    # ----------------------------------------------------------------------------- steps
    def add_step(self, p: RunProgress, result: StepResult, data_s: float, step_s: float, skipped: bool) -> None:
        """Count a step; a skipped step (a non-finite loss, trainer.on_nonfinite=skip) counts with a zero loss and no samples' loss."""
        if skipped:
            result = StepResult(result.loss.new_zeros(()), 0.0, 0, [], result.samples)
            self.window_skipped += 1
        for meter in (self.window, p.epoch_meter):
            meter.add(result, data_s, step_s)
        p.step += 1
        p.train_seconds += data_s + step_s
        p.samples += result.samples
        p.tokens += result.count if self.task.metric == "ppl" else 0

    def bar_stats(self) -> str:
        w, lm = self.window, self.task.metric == "ppl"  # a language model's throughput is in tokens
        rate = (w.count if lm else w.samples) / max(w.seconds(), 1e-9)
        return f"loss {w.mean_loss():.4f}  {rate:,.0f} {'tokens' if lm else 'samples'}/s"

    def log_step(self, p: RunProgress, epoch: int, lr: float, scale: float, bar: ProgressBar) -> None:
        """At a log step: the window's means (the only reads of the steps' numbers), then a new window."""
        if self.window.steps > self.window_skipped:  # skipped steps alone have no loss to log
            bar.show(self.bar_stats())
            self._train_record(p, epoch, lr, scale, bar.enabled)
        self.window, self.window_skipped = Meter(), 0

    def _train_record(self, p: RunProgress, epoch: int, lr: float, scale: float, bar_on: bool) -> None:
        metric, w = self.task.metric, self._global(self.window)
        seconds = max(w.seconds(), 1e-9)
        # The window on this process's wall clock: besides data and step time, the loop's own work,
        # the logging, and an evaluation or checkpoint that fell into the window.
        wall = time.perf_counter() - self.window._started
        values: dict[str, Any] = dict(
            step=p.step, epoch=epoch + 1, loss=w.mean_loss(), lr=lr, loss_scale=scale,
            samples_per_s=w.samples / seconds, data_time=w.data_time / w.steps, step_time=w.step_time / w.steps,
            step_wall_time=wall / w.steps,
        )
        values[metric] = w.metric(metric)
        balance = take_balance()  # MoE models: the routers' load-balancing loss, mean over this rank's microbatches since the last record
        if balance is not None:
            values["router_balance"] = balance
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

    def _global(self, m: Meter) -> Meter:
        """A meter's sums over all ranks (counts added, times averaged): what the run as a whole did."""
        d = self.dist
        return m if d.world == 1 else Meter.from_sums(d.sum(m.sums(), "the averaging of logged metrics"), m.steps, d.world)

    # ----------------------------------------------------------------------------- evaluations, epochs, files
    def evaluated(self, p: RunProgress, epoch: int, result: dict[str, float], seconds: float) -> None:
        """`seconds`: the evaluation on the wall clock, the wait for the newest weights included."""
        p.last_eval, p.last_eval_step = result, p.step
        self.metrics.add("eval", step=p.step, epoch=epoch + 1, **result, eval_time=seconds, time=p.train_seconds)

    def end_epoch(self, p: RunProgress, epoch: int) -> None:
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
        self.write_files(every_s=PLOT_EVERY_S)

    def write_files(self, plot: bool = True, every_s: float = 0.0) -> None:
        """metrics.csv and curves.png, the latter unless drawn less than ``every_s`` seconds ago. A run stopped by
        a signal passes ``plot=False``: drawing (importing matplotlib) took 3 s of its grace period on the loaded
        dev machine; the resumed run draws the curves."""
        if self.dist.main:
            self.metrics.write_csv()
            now = time.monotonic()
            if plot and (self.plotted_at is None or now - self.plotted_at >= every_s):
                plot_curves(self.metrics.records, self.run_dir / "curves.png", self.task.metric)
                self.plotted_at = now

    # ----------------------------------------------------------------------------- the end
    def summary(self, p: RunProgress, cfg: Any, overrides: list[str], params: int, checkpoint: Path, resume: Optional[Path]) -> dict:
        metric = self.task.metric
        p = global_progress(p, self.dist)
        m = p.epoch_meter
        final = {"train_loss": m.mean_loss(), f"train_{metric}": m.metric(metric)}
        final.update({f"test_{k}": v for k, v in p.last_eval.items()})
        seconds = max(p.train_seconds, 1e-9)
        summary = {
            "status": "completed", "model": cfg.model.name, "params": params, "data": cfg.data.name,
            "steps": p.step, "epochs": len(self.metrics.of_kind("epoch")), "final": final,
            "samples_per_s": p.samples / seconds, "train_seconds": p.train_seconds, "overrides": overrides,
            "run_dir": str(self.run_dir), "checkpoint": str(checkpoint), "resumed_from": str(resume) if resume else None,
            "world_size": self.dist.world,
        }
        if metric == "ppl":
            summary["tokens_per_s"] = p.tokens / seconds
        return summary

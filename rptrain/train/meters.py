"""Running sums of the training loop (per log window, per epoch) and where a run is.

A step's loss and correct counts arrive as tensors (the counts on the GPU when the model runs
there): a Meter keeps references to them and sums and reads them back only when a number is
asked for (log steps, epoch ends, checkpoints), so the loop never waits for the GPU between log
steps and spends no tensor operation per step.

RunProgress is everything besides model, optimizer and data state that a checkpoint must carry
for a resumed run to report the same metrics (the epoch's running sums included).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch
from torch import Tensor

from .tasks import StepResult, device_sum, perplexity


FOLD_STEPS = 1024  # steps whose tensors a meter keeps before adding them up


@dataclass
class Meter:
    """Running sums over a log window or an epoch. The losses (with their factors) and correct
    counts of the steps since the last read wait in ``_losses``/``_factors``/``_correct`` until
    ``settle()``."""

    loss: float = 0.0  # sum of mean-loss x count
    count: int = 0
    correct: int = 0
    samples: int = 0
    steps: int = 0
    data_time: float = 0.0
    step_time: float = 0.0
    _losses: list[Tensor] = field(default_factory=list, repr=False, compare=False)
    _factors: list[float] = field(default_factory=list, repr=False, compare=False)
    _correct: list[Tensor] = field(default_factory=list, repr=False, compare=False)
    # When the meter's span began on the wall clock; None when part of it ran in another process (resume).
    _started: Optional[float] = field(default_factory=time.perf_counter, repr=False, compare=False)

    def add(self, r: StepResult, data_time: float, step_time: float) -> None:
        self._losses.append(r.loss)
        self._factors.append(r.loss_factor * r.count)
        self._correct += r.correct
        if len(self._losses) >= FOLD_STEPS:  # a long epoch: sum what waits, on the device, without reading it
            self._losses, self._factors = [device_sum_weighted(self._losses, self._factors)], [1.0]
            self._correct = [device_sum(self._correct)] if self._correct else []
        self.count += r.count
        self.samples += r.samples
        self.steps += 1
        self.data_time += data_time
        self.step_time += step_time

    def settle(self) -> "Meter":
        """Add the pending steps into the float sums: one read per kind, the one wait for the GPU."""
        if self._losses:
            losses = device_sum_weighted(self._losses, self._factors)
            self.loss += losses.item()
            self._losses, self._factors = [], []
        if self._correct:
            self.correct += int(device_sum(self._correct).item())
            self._correct = []
        return self

    def state(self) -> dict:
        """The sums as plain numbers (what a checkpoint stores)."""
        self.settle()
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def mean_loss(self) -> float:
        self.settle()
        return self.loss / max(self.count, 1)

    def metric(self, name: str) -> float:
        self.settle()
        return self.correct / max(self.samples, 1) if name == "acc" else perplexity(self.mean_loss())

    def seconds(self) -> float:
        return self.data_time + self.step_time

    # Several ranks: counts add up over the ranks, times are averaged over them.
    def sums(self) -> list[float]:
        self.settle()
        return [self.loss, self.count, self.correct, self.samples, self.data_time, self.step_time]

    @classmethod
    def from_sums(cls, sums: list[float], steps: int, world: int) -> "Meter":
        loss, count, correct, samples, data_time, step_time = sums
        return cls(loss, int(round(count)), int(round(correct)), int(round(samples)), steps, data_time / world, step_time / world)


@dataclass
class RunProgress:
    """Where the run is; saved in every checkpoint."""

    step: int = 0
    epoch_meter: Meter = field(default_factory=Meter)
    last_eval: dict = field(default_factory=dict)
    last_eval_step: int = -1
    train_seconds: float = 0.0
    samples: int = 0
    tokens: int = 0


def device_sum_weighted(values: list[Tensor], weights: list[float]) -> Tensor:
    """sum(v x w) in float64 on the first value's device (0-d values)."""
    first = values[0]
    stacked = torch.stack([v.to(first.device, non_blocking=True) for v in values]).double()
    return stacked @ torch.tensor(weights, dtype=torch.float64).to(first.device, non_blocking=True)


def epoch_rate(m: Meter, samples: int) -> dict:
    """The whole epoch on the wall clock (its steps, its evaluation, the logging in between) and
    ``samples`` (the epoch's training samples, over every rank) per second of it. None for an
    epoch resumed in its middle: part of it ran in another process."""
    if m._started is None:
        return {"epoch_wall_time": None, "epoch_samples_per_s": None}
    wall = time.perf_counter() - m._started
    return {"epoch_wall_time": wall, "epoch_samples_per_s": samples / max(wall, 1e-9)}


def progress_state(p: RunProgress) -> dict:
    return {
        "step": p.step, "epoch_meter": p.epoch_meter.state(), "last_eval": dict(p.last_eval),
        "last_eval_step": p.last_eval_step, "train_seconds": p.train_seconds, "samples": p.samples, "tokens": p.tokens,
    }


def progress_from(state: dict) -> RunProgress:
    return RunProgress(
        step=int(state["step"]), epoch_meter=Meter(**state["epoch_meter"], _started=None), last_eval=dict(state["last_eval"]),
        last_eval_step=int(state["last_eval_step"]), train_seconds=float(state["train_seconds"]),
        samples=int(state["samples"]), tokens=int(state["tokens"]),
    )


def rank_share(p: RunProgress, main: bool) -> RunProgress:
    """A checkpoint's progress (totals over every rank) as this rank's part of it: rank 0 holds the
    counts and the others zero, so that adding the ranks up gives the totals again. Times are
    averaged over the ranks, so every rank keeps them."""
    if main:
        return p
    m = p.epoch_meter.settle()
    meter = Meter(0.0, 0, 0, 0, m.steps, m.data_time, m.step_time, _started=m._started)
    return RunProgress(p.step, meter, dict(p.last_eval), p.last_eval_step, p.train_seconds, 0, 0)


def global_progress(p: RunProgress, d: Any) -> RunProgress:
    """The run's progress summed over the ranks of `d` (a dist.Dist): what a checkpoint stores and
    the summary reports (see rank_share)."""
    if d.world == 1:
        return p
    sums = d.sum([*p.epoch_meter.sums(), p.samples, p.tokens], "the summing of progress counters")
    total = copy.copy(p)
    total.epoch_meter = Meter.from_sums(sums[:6], p.epoch_meter.steps, d.world)
    total.samples, total.tokens = int(round(sums[6])), int(round(sums[7]))
    return total

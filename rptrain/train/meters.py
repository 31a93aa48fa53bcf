"""Running sums of the training loop (per log window, per epoch) and where a run is.

RunProgress is everything besides model, optimizer and data state that a checkpoint must carry
for a resumed run to report the same metrics (the epoch's running sums included).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .tasks import StepResult, perplexity


@dataclass
class Meter:
    """Running sums over a log window or an epoch."""

    loss: float = 0.0  # sum of mean-loss x count
    count: int = 0
    correct: int = 0
    samples: int = 0
    steps: int = 0
    data_time: float = 0.0
    step_time: float = 0.0

    def add(self, r: StepResult, data_time: float, step_time: float) -> None:
        self.loss += r.loss * r.count
        self.count += r.count
        self.correct += r.correct
        self.samples += r.samples
        self.steps += 1
        self.data_time += data_time
        self.step_time += step_time

    def mean_loss(self) -> float:
        return self.loss / max(self.count, 1)

    def metric(self, name: str) -> float:
        return self.correct / max(self.samples, 1) if name == "acc" else perplexity(self.mean_loss())

    def seconds(self) -> float:
        return self.data_time + self.step_time

    # Several ranks: counts add up over the ranks, times are averaged over them.
    def sums(self) -> list[float]:
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


def progress_state(p: RunProgress) -> dict:
    return {
        "step": p.step, "epoch_meter": vars(p.epoch_meter).copy(), "last_eval": dict(p.last_eval),
        "last_eval_step": p.last_eval_step, "train_seconds": p.train_seconds, "samples": p.samples, "tokens": p.tokens,
    }


def progress_from(state: dict) -> RunProgress:
    return RunProgress(
        step=int(state["step"]), epoch_meter=Meter(**state["epoch_meter"]), last_eval=dict(state["last_eval"]),
        last_eval_step=int(state["last_eval_step"]), train_seconds=float(state["train_seconds"]),
        samples=int(state["samples"]), tokens=int(state["tokens"]),
    )


def rank_share(p: RunProgress, main: bool) -> RunProgress:
    """A checkpoint's progress (totals over every rank) as this rank's part of it: rank 0 holds the
    counts and the others zero, so that adding the ranks up gives the totals again. Times are
    averaged over the ranks, so every rank keeps them."""
    if main:
        return p
    m = p.epoch_meter
    meter = Meter(0.0, 0, 0, 0, m.steps, m.data_time, m.step_time)
    return RunProgress(p.step, meter, dict(p.last_eval), p.last_eval_step, p.train_seconds, 0, 0)

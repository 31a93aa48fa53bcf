"""What one training step and one evaluation mean for each kind of model.

Image classifiers: the engine returns logits; the loss is cross entropy summed over the batch
and divided by the batch size, so uneven microbatch splits still give the batch mean.
Language models (rptrain.models Llama): the Sequential's first layer takes one argument, the
tuple (ids, targets) or (ids, targets, segment_ids) for packed data, and the last returns the summed
token cross entropy; dividing by the batch's count of trained tokens (targets != IGNORE_INDEX) gives
the mean per token, so masked prompt and padding positions count neither in the loss nor in tokens/s.
Several ranks: the loop passes `total`, the count summed over the ranks, and the loss is
sum x world / total: the engine's average of the ranks' gradients is then exactly the gradient
of the mean over the global batch, even when ranks hold different token counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from rptrain import GradScaler, RoundPipe, RoundPipeRunConfig
from rptrain.models import count_tokens

from .model import IMAGE


@dataclass
class StepResult:
    loss: float  # mean loss of the batch (unscaled)
    count: int  # what the loss is a mean over: samples or tokens
    correct: int  # correctly classified samples (image models)
    samples: int


class Task:
    """Shared by both kinds: microbatch counts that never exceed a (last, short) batch."""

    metric = "acc"  # the second number next to the loss: accuracy or perplexity

    def __init__(self, num_microbatch: int, dtype: torch.dtype, world: int = 1) -> None:
        self.num_microbatch = num_microbatch
        self.dtype = dtype
        self.world = world

    def count(self, batch: tuple) -> int:
        """What this batch's loss is a mean over: samples or tokens."""
        raise NotImplementedError

    def divisor(self, count: int, total: Optional[int]) -> tuple[float, float]:
        """(what the summed loss is divided by, the factor from that back to this batch's mean)."""
        if total is None or self.world == 1:
            return float(count), 1.0
        share = total / self.world
        return share, share / count  # 1.0 exactly when every rank holds the same count

    def run_config(self, batch: int) -> Optional[RoundPipeRunConfig]:
        """A per-call override for a batch smaller than num_microbatch (e.g. the tutorial's last batch)."""
        return RoundPipeRunConfig(num_microbatch=batch) if batch < self.num_microbatch else None

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler, total: Optional[int] = None) -> StepResult:
        raise NotImplementedError

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        raise NotImplementedError


class ImageTask(Task):
    metric = "acc"

    def count(self, batch: tuple) -> int:
        return len(batch[1])

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler, total: Optional[int] = None) -> StepResult:
        images, labels = batch
        n = len(labels)
        divisor, to_mean = self.divisor(n, total)
        scale = scaler.get_scale()  # update() may change it before we read the loss back
        loss, logits = engine.forward_backward(
            input_args=(images.to(self.dtype),),
            label=labels,
            loss_fn=lambda out, y: scaler.scale(F.cross_entropy(out.float(), y, reduction="sum") / divisor),
            return_outputs=True,
            run_config=self.run_config(n),
        )
        correct = int((logits.argmax(1) == labels.to(logits.device)).sum())
        return StepResult(loss.item() / scale * to_mean, n, correct, n)

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        loss_sum, correct, total = 0.0, 0, 0
        for images, labels in batches:
            logits = engine(images.to(self.dtype), run_config=self.run_config(len(labels)))
            labels = labels.to(logits.device)
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
            correct += int((logits.argmax(1) == labels).sum())
            total += len(labels)
        return {"loss": loss_sum / max(total, 1), "acc": correct / max(total, 1)}


class LanguageTask(Task):
    metric = "ppl"

    def count(self, batch: tuple) -> int:
        return count_tokens(batch[1])

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler, total: Optional[int] = None) -> StepResult:
        ids, targets = batch[:2]  # then segment ids, when the data packs several documents a row
        tokens = count_tokens(targets)
        divisor, to_mean = self.divisor(tokens, total)
        scale = scaler.get_scale()
        loss = engine.forward_backward(
            input_args=(tuple(batch),),
            label=None,
            loss_fn=lambda out, _: scaler.scale(out / divisor),
            run_config=self.run_config(len(ids)),
        )
        return StepResult(loss.item() / scale * to_mean, tokens, 0, len(ids))

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        loss_sum, total = 0.0, 0
        for batch in batches:
            ids, targets = batch[:2]
            loss_sum += engine(tuple(batch), run_config=self.run_config(len(ids))).float().sum().item()
            total += count_tokens(targets)
        loss = loss_sum / max(total, 1)
        return {"loss": loss, "ppl": perplexity(loss)}


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 80.0))  # capped: a diverged run should log a number, not inf


def make_task(kind: str, num_microbatch: int, dtype: torch.dtype, world: int = 1) -> Task:
    return (ImageTask if kind == IMAGE else LanguageTask)(num_microbatch, dtype, world)

"""What one training step and one evaluation mean for each kind of model.

Image classifiers: the engine returns logits; the loss is cross entropy summed over the batch
and divided by the batch size, so uneven microbatch splits still give the batch mean.
Language models (rptrain.models Llama): the Sequential's first layer takes one argument, the
tuple (ids, targets), and the last returns the summed token cross entropy; dividing by the
batch's token count gives the mean per token.
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

    def __init__(self, num_microbatch: int, dtype: torch.dtype) -> None:
        self.num_microbatch = num_microbatch
        self.dtype = dtype

    def run_config(self, batch: int) -> Optional[RoundPipeRunConfig]:
        """A per-call override for a batch smaller than num_microbatch (e.g. the tutorial's last batch)."""
        return RoundPipeRunConfig(num_microbatch=batch) if batch < self.num_microbatch else None

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler) -> StepResult:
        raise NotImplementedError

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        raise NotImplementedError


class ImageTask(Task):
    metric = "acc"

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler) -> StepResult:
        images, labels = batch
        n = len(labels)
        scale = scaler.get_scale()  # update() may change it before we read the loss back
        loss, logits = engine.forward_backward(
            input_args=(images.to(self.dtype),),
            label=labels,
            loss_fn=lambda out, y: scaler.scale(F.cross_entropy(out.float(), y, reduction="sum") / n),
            return_outputs=True,
            run_config=self.run_config(n),
        )
        correct = int((logits.argmax(1) == labels.to(logits.device)).sum())
        return StepResult(loss.item() / scale, n, correct, n)

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

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler) -> StepResult:
        ids, targets = batch
        tokens = count_tokens(targets)
        scale = scaler.get_scale()
        loss = engine.forward_backward(
            input_args=((ids, targets),),
            label=None,
            loss_fn=lambda out, _: scaler.scale(out / tokens),
            run_config=self.run_config(len(ids)),
        )
        return StepResult(loss.item() / scale, tokens, 0, len(ids))

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        loss_sum, total = 0.0, 0
        for ids, targets in batches:
            loss_sum += engine((ids, targets), run_config=self.run_config(len(ids))).float().sum().item()
            total += count_tokens(targets)
        loss = loss_sum / max(total, 1)
        return {"loss": loss, "ppl": perplexity(loss)}


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 80.0))  # capped: a diverged run should log a number, not inf


def make_task(kind: str, num_microbatch: int, dtype: torch.dtype) -> Task:
    return (ImageTask if kind == IMAGE else LanguageTask)(num_microbatch, dtype)

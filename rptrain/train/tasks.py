"""What one training step and one evaluation mean for each kind of model.

Image classifiers: the engine returns logits; the loss is cross entropy summed over the batch
and divided by the batch size, so uneven microbatch splits still give the batch mean.
Language models (rptrain.models Llama): the Sequential's first layer takes one argument, the
tuple (ids, targets) or (ids, targets, segment_ids) for packed data, and the last returns the summed
token cross entropy; dividing by the batch's count of trained tokens (targets != IGNORE_INDEX) gives
the mean per token, so masked prompt and padding positions count neither in the loss nor in tokens/s.
Nothing here reads a number back from the GPU during training: a step's loss and correct count
stay tensors (the count is taken from logits returned where the labels are, so they never leave
the GPU) and meters.Meter reads them at log steps. Evaluation reads once per pass.
Several ranks: the loop passes `total`, the count summed over the ranks, and the loss is
sum x world / total: the engine's average of the ranks' gradients is then exactly the gradient
of the mean over the global batch, even when ranks hold different token counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rptrain import GradScaler, RoundPipe, RoundPipeRunConfig
from rptrain.models import count_tokens
from rptrain.models.moe import take_balance

from .model import IMAGE


@dataclass
class StepResult:
    """A step's numbers, not yet read back: per step the loop only keeps references to them."""

    loss: Tensor  # what forward_backward returned (0-d): x loss_factor = the batch's mean loss
    loss_factor: float  # undoes the loss scale (and the rank share of several ranks)
    count: int  # what the loss is a mean over: samples or tokens
    correct: list[Tensor]  # correctly classified samples per microbatch (image models), 0-d, on the device
    samples: int


class Task:
    """Shared by both kinds: microbatch counts that never exceed a (last, short) batch."""

    metric = "acc"  # the second number next to the loss: accuracy or perplexity

    def __init__(self, num_microbatch: int, dtype: torch.dtype, world: int = 1, eval_microbatch: Optional[int] = None) -> None:
        self.num_microbatch = num_microbatch
        self.eval_microbatch = eval_microbatch  # None: the run config's, as training
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

    def run_config(self, batch: int, output_device: Optional[torch.device] = None, evaluating: bool = False,
                   merge_output: Optional[Callable[[list], Tensor]] = None) -> Optional[RoundPipeRunConfig]:
        """A per-call override for a batch smaller than num_microbatch (e.g. the tutorial's last
        batch), for an evaluation's own microbatch count, where the outputs should land (None:
        the run config's choice) and how the microbatches' outputs merge (None: the engine's way)."""
        wanted = self.eval_microbatch if evaluating and self.eval_microbatch else self.num_microbatch
        count = min(batch, wanted) if batch < wanted or wanted != self.num_microbatch else None
        if count is None and output_device is None and merge_output is None:
            return None
        return RoundPipeRunConfig(num_microbatch=count, output_device=output_device, merge_output=merge_output)

    def inputs(self, batch: tuple) -> tuple:
        """The engine's input arguments for this batch (the model's forward arguments)."""
        raise NotImplementedError

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler, total: Optional[int] = None) -> StepResult:
        raise NotImplementedError

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        raise NotImplementedError


class ImageTask(Task):
    metric = "acc"

    def count(self, batch: tuple) -> int:
        return len(batch[1])

    def inputs(self, batch: tuple) -> tuple:
        return (batch[0].to(self.dtype),)

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler, total: Optional[int] = None) -> StepResult:
        images, labels = batch
        n = len(labels)
        divisor, to_mean = self.divisor(n, total)
        scale = scaler.get_scale()  # update() may change it before the loss is read

        # No side effects: the engine may replay the whole call as one recorded CUDA graph, which
        # never calls loss_fn again (engine/wholecall.py); the count is taken from the returned logits,
        # which stay where the labels are.
        def loss_fn(out: Tensor, y: Tensor) -> Tensor:
            return scaler.scale(F.cross_entropy(out.float(), y, reduction="sum") / divisor)

        loss, logits = engine.forward_backward(input_args=self.inputs(batch), label=labels, loss_fn=loss_fn, return_outputs=True,
                                               run_config=self.run_config(n, labels.device))
        return StepResult(loss.detach(), to_mean / scale, n, [(logits.argmax(1) == labels).sum()], n)

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        loss_sums, corrects, total = [], [], 0
        for images, labels in batches:
            # The logits land where the labels are (the GPU for GPU-augmented data): nothing to read back.
            logits = engine(images.to(self.dtype), run_config=self.run_config(len(labels), labels.device, evaluating=True))
            loss_sums.append(F.cross_entropy(logits.float(), labels, reduction="sum").double())
            corrects.append((logits.argmax(1) == labels).sum())
            total += len(labels)
        loss_sum, correct = (float(device_sum(v)) if v else 0.0 for v in (loss_sums, corrects))
        return {"loss": loss_sum / max(total, 1), "acc": correct / max(total, 1)}


class LanguageTask(Task):
    metric = "ppl"

    def count(self, batch: tuple) -> int:
        return count_tokens(batch[1])

    def inputs(self, batch: tuple) -> tuple:
        return (tuple(batch),)  # the first layer takes (ids, targets[, segment_ids]) as one argument

    def train_step(self, engine: RoundPipe, batch: tuple, scaler: GradScaler, total: Optional[int] = None) -> StepResult:
        ids, targets = batch[:2]  # then segment ids, when the data packs several documents a row
        tokens = count_tokens(targets)
        divisor, to_mean = self.divisor(tokens, total)
        scale = scaler.get_scale()
        loss = engine.forward_backward(
            input_args=self.inputs(batch),
            label=None,
            loss_fn=lambda out, _: scaler.scale(out / divisor),
            run_config=self.run_config(len(ids)),
        )
        return StepResult(loss.detach(), to_mean / scale, tokens, [], len(ids))

    def evaluate(self, engine: RoundPipe, batches: Iterable[tuple]) -> dict[str, float]:
        loss_sums, total = [], 0
        take_balance()  # the training microbatches' belong to the next train record
        for batch in batches:
            ids, targets = batch[:2]
            # Each microbatch returns its summed token loss: they add up (the engine's automatic merge
            # of 0-d outputs is their mean, which would divide the loss by the number of microbatches).
            call = self.run_config(len(ids), evaluating=True, merge_output=device_sum)
            loss_sums.append(engine(tuple(batch), run_config=call).double())
            total += count_tokens(targets)
        loss = (float(device_sum(loss_sums)) if loss_sums else 0.0) / max(total, 1)
        balance = take_balance()  # MoE models: the routers' load-balancing loss over the eval batches
        return {"loss": loss, "ppl": perplexity(loss), **({} if balance is None else {"router_balance": balance})}


def device_sum(values: list[Tensor]) -> Tensor:
    """Sum of 0-d tensors, on the first one's device, without reading any of them back (with
    several GPUs the microbatches' counts may sit on different ones)."""
    first = values[0]
    if len(values) == 1:
        return first
    return torch.stack([v.to(first.device, non_blocking=True) for v in values]).sum()


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 80.0))  # capped: a diverged run should log a number, not inf


def make_task(kind: str, num_microbatch: int, dtype: torch.dtype, world: int = 1, eval_microbatch: Optional[int] = None) -> Task:
    return (ImageTask if kind == IMAGE else LanguageTask)(num_microbatch, dtype, world, eval_microbatch)

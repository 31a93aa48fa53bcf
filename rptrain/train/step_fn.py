"""The function each engine.step runs on the optimizer thread, and the watch for non-finite losses.

A step is: clip (optim.clip_grad_norm), the optimizer step through the GradScaler, zero_grad and
the schedule. GradScaler skips the update when fp16 gradients overflow, by design. Without one,
non-finite values are ours to catch: the loss, and with trainer.on_nonfinite=skip also gradients
that overflowed under a finite loss (averaged over the ranks, so every rank decides the same).

on_nonfinite=skip (its logged means leave the step out) and several ranks (they must agree) read the
loss on the main thread, one wait for the device a step. The default, stop, with one process looks
at it on the optimizer thread instead, so the loop never waits for the device.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

from rptrain import GradScaler, RoundPipe

from .dist import Dist
from .errors import NonFiniteLoss

class StepFunctions:
    def __init__(self, optimizer: Any, scheduler: Any, scaler: GradScaler, clip: Optional[float], on_nonfinite: str,
                 d: Dist, kept: Callable[[], str]) -> None:
        self.optimizer, self.scheduler, self.scaler, self.clip, self.dist = optimizer, scheduler, scaler, clip, d
        self.kept = kept  # what a stop leaves behind (the newest checkpoint), for the message
        self.params = [q for g in optimizer.param_groups for q in g["params"]]
        self.guard = not scaler.is_enabled()
        self.skip = self.guard and on_nonfinite == "skip"
        self.check_here = self.guard and (self.skip or d.world > 1)
        self.failed: list[int] = []  # steps whose loss the optimizer thread found non-finite
        # The schedule advances on a skipped step too (as in torch's AMP recipes), which torch would
        # warn about on every GradScaler skip. Set per run: a caller may have reset the filters since.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based), computed: no race with the optimizer thread."""
        return self.scheduler.base_lrs[0] * self.scheduler.lr_lambdas[0](step)

    def for_step(self, loss: torch.Tensor, step: int) -> tuple[Callable[[], None], bool]:
        """What engine.step runs after step `step` (1-based), and whether that step is skipped here
        (on_nonfinite=skip). Raises NonFiniteLoss before the update when the run stops on it."""
        if self.check_here:
            if self._nonfinite(loss, step):
                return self._skip, True
            return self._step, False
        if self.guard:
            return self._finite_step(loss, step), False
        return self._step, False

    def check(self, engine: Optional[RoundPipe] = None) -> None:
        """Raise if the optimizer thread skipped an update for a non-finite loss; `engine`: wait for its steps first."""
        if engine is not None and self.guard and not self.check_here:
            engine.synchronize()
        if self.failed:
            raise NonFiniteLoss(self.message(self.failed[0]))

    def message(self, step: int) -> str:
        return (
            f"the training loss is not finite (NaN or inf) at step {step} (without a GradScaler nothing skips it): the weights were not "
            f"updated with it and {self.kept()}; lower optim.optimizer.lr, set optim.clip_grad_norm, or let such steps be skipped with trainer.on_nonfinite=skip"
        )

    def _skip(self) -> None:  # a step without the update; the schedule advances, as GradScaler's skips do
        self.optimizer.zero_grad()
        self.scheduler.step()

    def _step(self) -> None:
        if self.skip and not all(bool(torch.isfinite(q.grad).all()) for q in self.params if q.grad is not None):
            return self._skip()
        if self.clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.scaler.step(self.optimizer)
        self.optimizer.zero_grad()
        self.scheduler.step()

    def _finite_step(self, loss: torch.Tensor, step: int) -> Callable[[], None]:
        def run() -> None:  # on the optimizer thread: the update never sees a non-finite loss
            if not bool(torch.isfinite(loss).all()):
                self.failed.append(step)
                return self._skip()
            self._step()
        return run

    def _nonfinite(self, loss: torch.Tensor, step: int) -> bool:
        """Whether this step's loss is NaN/inf on any rank (then every rank skips or stops alike)."""
        bad = float(not bool(torch.isfinite(loss)))
        if self.dist.world > 1:
            bad = self.dist.sum([bad], "the check for a non-finite loss")[0]
        if bad and not self.skip:  # before the step: the update never happens, the last checkpoint stays the last
            raise NonFiniteLoss(self.message(step))
        return bad > 0

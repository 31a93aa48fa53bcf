"""A call's microbatches as one batch on the stage-by-stage path (fusion.py says when that is exact).

The whole-call path (wholecall.py) runs an eligible call's microbatches as one batch inside its
recording. Every other training call on the same single GPU must do the same, or a run would round
differently depending on the path a call took: a fresh engine's first call measures its layers stage
by stage (planning.py), so a run resumed into a new engine would differ at that call from the
uninterrupted run, whose same call replayed the whole call. Here a call is rewritten before it runs:
one microbatch holding the joined batch, a ``loss_fn`` that takes each microbatch's loss on its slice
of the outputs with its own label and hands every loss to one backward, and each BatchNorm run once
per slice (``PassState.fused_sizes``; the executor applies ``fusion.statistics_per_microbatch``).
Afterwards the call's losses and outputs are given back per microbatch, as if they had run apart.
Several GPUs keep their microbatches apart: they are the pipeline's parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from torch import Tensor, nn

from . import fusion
from .batching import join_cut
from .compute import loss_scalars
from .tuning import Tuning


class FusedLoss:
    """The user's ``loss_fn`` over the joined batch: each microbatch's slice with its label, every loss
    returned flat (the engine backpropagates all of them at once, as ``torch.autograd.backward``)."""

    def __init__(self, loss_fn: Callable, sizes: Sequence[int]):
        self.loss_fn, self.sizes = loss_fn, list(sizes)
        self.shapes: list[tuple[bool, int]] = []  # per microbatch: whether loss_fn returned one tensor, how many losses

    def __call__(self, outputs: Any, labels: Sequence[Any]) -> list[Tensor]:
        flat, self.shapes = [], []
        try:
            parts = fusion.split(outputs, self.sizes)
        except ValueError as e:  # e.g. a layer returning a tensor of its own beside the batch's
            raise ValueError(f"rptrain: the microbatches ran as one batch, but {e}; "
                             "RoundPipe(..., tuning=Tuning(fuse_microbatches=False)) runs them apart") from None
        for part, label in zip(parts, labels):
            loss = self.loss_fn(part, label)
            items = loss_scalars(loss)
            self.shapes.append((isinstance(loss, Tensor), len(items)))
            flat += items
        return flat

    def per_microbatch(self, flat: Any) -> list:
        """The call's kept losses back in the engine's per-microbatch form (a tensor, or a list of them)."""
        flat = [flat] if isinstance(flat, Tensor) else list(flat)
        out, at = [], 0
        for single, count in self.shapes:
            out.append(flat[at] if single else flat[at : at + count])
            at += count
        return out


@dataclass
class CallParts:
    """What a training call runs: its microbatches as split (``sizes`` None), or one microbatch joining them."""

    inputs: list  # the microbatches (Args), or one: the joined batch
    labels: list  # their labels, or one: every microbatch's, in a list
    loss_fn: Callable  # the user's, or a FusedLoss over it
    sizes: Optional[list[int]] = None  # the joined microbatches' sizes

    def unfuse(self, losses: list, outputs: list) -> tuple[list, list]:
        """The call's losses and outputs per microbatch."""
        if self.sizes is None:
            return losses, outputs
        return self.loss_fn.per_microbatch(losses[0]), self.outputs_apart(outputs)

    def outputs_apart(self, outputs: list) -> list:
        """The call's outputs per microbatch."""
        if self.sizes is None:
            return outputs
        return fusion.split(outputs[0], self.sizes) if outputs[0] is not None else [None] * len(self.sizes)


class CallFusion:
    """Decides, per training call, whether it runs as one batch here."""

    def __init__(self, layers: Sequence[nn.Module], tuning: Tuning, cuda: bool, num_devices: int, reducing: bool):
        self.layers = list(layers)
        # Where the microbatches stay apart whatever the call: the CPU engine (one microbatch by default), several
        # GPUs (their microbatches are the pipeline's parallelism), data-parallel processes (not measured here).
        self.here = ("no GPU" if not cuda else f"{num_devices} GPUs: their microbatches are the pipeline's parallelism"
                     if num_devices > 1 else "gradients are averaged across processes" if reducing else None)
        self._verdicts = fusion.Verdicts(tuning)
        self.apart: Optional[str] = None  # why every call from now on keeps them apart (the planner's measurement)
        self.microbatches: Optional[str] = None  # how the newest stage-by-stage call ran them: as one batch, or why apart
        self.joined: Optional[bool] = None  # whether the newest call ran as one batch here (None: it took the whole-call path)

    def prepare_forward(self, inputs: list) -> CallParts:
        """A forward call that records nothing for a backward (an evaluation): its microbatches as one batch where
        a training call's would be (the same rules; BatchNorm in training mode still per slice). Only the kernels'
        size changes, so ``microbatches`` and ``joined``, which describe training calls, are left alone."""
        given = CallParts(list(inputs), [None] * len(inputs), lambda outputs, label: outputs)
        if len(inputs) < 2:
            return given
        joined, sizes, why = self._join(inputs, self.here or self.apart)
        return given if why is not None else CallParts([joined], [None], given.loss_fn, sizes)

    def prepare(self, inputs: list, labels: list, loss_fn: Callable, whole: Callable[[], bool], input_requires_grad: bool) -> CallParts:
        """``inputs``: the call's microbatches (Args) as split from the caller's tensors; ``whole()``: whether
        the call takes the whole-call path, which joins them inside its recording itself (asked only where
        this GPU may join them)."""
        given = CallParts(list(inputs), list(labels), loss_fn)
        self.joined = False
        if len(inputs) < 2:
            return given
        if self.here is None and whole():
            self.joined = None
            return given
        joined, sizes, why = self._join(inputs, self.here or self.apart or ("inputs need gradients" if input_requires_grad else None))
        self.microbatches = "as one batch (fused_call.py)" if why is None else f"apart: {why}"
        if why is not None:
            return given
        self.joined = True
        return CallParts([joined], [list(labels)], FusedLoss(loss_fn, sizes), sizes)

    def _join(self, inputs: list, why: Optional[str]) -> tuple[Any, Optional[list[int]], Optional[str]]:
        """(the joined batch, the microbatches' sizes, None) where ``inputs`` may run as one batch, else (None, None,
        why not); ``why``: a reason already known to keep them apart."""
        if why is None:
            sizes, why = self._verdicts.sizes(self.layers, inputs, inputs)
        if why is None:
            try:
                return join_cut(list(inputs)), sizes, None  # the caller's batch itself: cut_along_batch held (Verdicts.sizes)
            except ValueError:  # a value other than a tensor differs between the microbatches
                why = "the microbatches' inputs differ in a value that is not a tensor"
        return None, None, why

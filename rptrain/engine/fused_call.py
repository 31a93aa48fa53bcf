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
from .batching import merge_outputs
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
class FusedCall:
    sizes: list[int]
    loss_fn: FusedLoss
    inputs: list  # one microbatch: the joined batch
    labels: list  # one label: every microbatch's, in a list

    def unfuse(self, losses: list, outputs: list) -> tuple[list, list]:
        """The one microbatch's losses and outputs given back per microbatch."""
        per_micro = self.loss_fn.per_microbatch(losses[0])
        return per_micro, (fusion.split(outputs[0], self.sizes) if outputs[0] is not None else [None] * len(self.sizes))


class CallFusion:
    """Decides, per training call, whether it runs as one batch here."""

    def __init__(self, layers: Sequence[nn.Module], tuning: Tuning, cuda: bool, num_devices: int, reducing: bool):
        self.layers, self.tuning = list(layers), tuning
        # Where the microbatches stay apart whatever the call: the CPU engine (one microbatch by default), several
        # GPUs (their microbatches are the pipeline's parallelism), data-parallel processes (not measured here).
        self.here = ("no GPU" if not cuda else f"{num_devices} GPUs: their microbatches are the pipeline's parallelism"
                     if num_devices > 1 else "gradients are averaged across processes" if reducing else None)
        self._apart: dict[tuple, Optional[str]] = {}  # the layers' ids and modes -> fusion.why_not
        self.microbatches: Optional[str] = None  # how the newest stage-by-stage call ran them: as one batch, or why apart
        self.joined: Optional[bool] = None  # whether the newest call ran as one batch here (None: it took the whole-call path)

    def fuse(self, inputs: list, labels: list, loss_fn: Callable, whole: bool, input_requires_grad: bool) -> Optional[FusedCall]:
        """``inputs``: the call's microbatches (Args) as split from the caller's tensors; ``whole``: the
        call takes the whole-call path, which fuses inside its recording itself."""
        self.joined = None if whole else False
        if whole or len(inputs) < 2:
            return None
        why, joined = self._why_not(inputs, input_requires_grad), None
        if why is None:
            try:
                joined = merge_outputs(list(inputs))
            except ValueError:  # a value other than a tensor differs between the microbatches
                why = "the microbatches' inputs differ in a value that is not a tensor"
        self.microbatches = "as one batch (fused_call.py)" if why is None else f"apart: {why}"
        if why is not None:
            return None
        self.joined = True
        sizes = fusion.microbatch_sizes(inputs)
        return FusedCall(sizes, FusedLoss(loss_fn, sizes), [joined], [list(labels)])

    def _why_not(self, inputs: list, input_requires_grad: bool) -> Optional[str]:
        if not self.tuning.fuse_microbatches:
            return "off (Tuning.fuse_microbatches=False)"
        if self.here is not None:
            return self.here
        if self.tuning.compile_stages:
            return "the stage is compiled (Tuning.compile_stages)"
        if input_requires_grad:
            return "inputs need gradients"
        sizes = fusion.microbatch_sizes(inputs)
        if sizes is None or 0 in sizes or not fusion.cut_along_batch(list(inputs)):
            return "the microbatches' inputs are not the batch cut along its first dimension"
        key = tuple((id(m), m.training) for layer in self.layers for m in layer.modules())
        if key not in self._apart:
            self._apart[key] = fusion.why_not(self.layers)
        return self._apart[key]

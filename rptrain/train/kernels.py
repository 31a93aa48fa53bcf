"""engine.cudnn_benchmark: cuDNN times its convolution algorithms for each new shape and keeps
the fastest, as the plain PyTorch the CLI is compared with does (bench/resnet.py). Off, cuDNN
picks by heuristics, which for small images in fp16 or channels-last can be slower. The flag is
process-wide: it is set for the run and restored after it (sweeps and tests share the process).

On, the search runs for the training batches of the run's usual size only: an epoch's last, smaller
batch and the evaluation's batches come once an epoch, and searching for their shapes cost more than
it could save. ResNet-34 on CIFAR-100 on an H100 (2026-12-06, `bench/main_job.py --epochs 2`, one
call, each run its own process): the first epoch took 13.4 s searching every shape and 2.9 s
searching none. From the two runs' log windows: about 7 s for the full batch's shapes (the first step),
about 3 s for the last batch's (80 images) and 0.5 s for the evaluation's tail (16 images), while
searched kernels made the later epochs 1.82 s instead of 1.93 s.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


@contextlib.contextmanager
def cudnn_benchmark(on: bool) -> Iterator[None]:
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


def _rows(batch: Any) -> Optional[int]:
    """The leading size of a batch's first tensor (its samples), None for a batch without one."""
    if isinstance(batch, torch.Tensor):
        return batch.size(0) if batch.dim() else None
    if isinstance(batch, (tuple, list)):
        return next((r for r in map(_rows, batch) if r is not None), None)
    if isinstance(batch, dict):
        return next((r for r in map(_rows, batch.values()) if r is not None), None)
    return None


class CudnnSearch:
    """Where engine.cudnn_benchmark is on, cuDNN searches for the shapes that repeat: the training batches of
    ``rows`` samples (this rank's share of trainer.batch_size). Call ``training(batch)`` before each step and
    ``evaluating()`` before an evaluation."""

    def __init__(self, on: bool, rows: int) -> None:
        self.on, self.rows = on, rows

    def training(self, batch: Any) -> None:
        torch.backends.cudnn.benchmark = self.on and _rows(batch) == self.rows

    def evaluating(self) -> None:
        torch.backends.cudnn.benchmark = False

"""engine.cudnn_benchmark: cuDNN times its convolution algorithms for each new shape and keeps
the fastest, as the plain PyTorch the CLI is compared with does (bench/resnet.py). Off, cuDNN
picks by heuristics, which for small images in fp16 or channels-last can be slower. The flag is
process-wide: it is set for the run and restored after it (sweeps and tests share the process).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def cudnn_benchmark(on: bool) -> Iterator[None]:
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous

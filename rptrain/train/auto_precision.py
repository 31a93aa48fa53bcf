"""precision=auto: the fastest precision for the machine the job runs on, chosen when the config is composed.

On a GPU that is the tutorial's fp16 compute copy with a GradScaler. On a CPU, fp16 arithmetic is
emulated (the README's ResNet example ran 100x slower than fp32), and bf16 was slower than fp32
too on the CPU we measured (2 AVX2 cores, no native bf16: a ResNet-34 step 25x, a llama_tiny step
2.5x), so the CPU gets fp32. conf/precision/auto.yaml reads the choice through the resolver
${rptrain.auto_precision:KEY}, so every later reader (the run, checkpoints, --cfg job --resolve)
sees plain values.
"""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

RESOLVER = "rptrain.auto_precision"


def auto_precision(key: str) -> object:
    """compute_dtype (a Dtype name) or grad_scaler (whether loss scaling is on) for this machine."""
    cuda = torch.cuda.is_available()
    values = {"compute_dtype": "float16" if cuda else "float32", "grad_scaler": cuda}
    return values[key]


def describe() -> str:
    """The one line printed at the start of a precision=auto run: what was chosen and why."""
    if torch.cuda.is_available():
        return "precision=auto: float16 compute with a GradScaler, fp32 master weights (a CUDA device is present)"
    return ("precision=auto: float32 compute (no CUDA device; on a CPU fp16 is emulated and bf16 measured 2.5-25x "
            "slower than fp32 on 2 AVX2 cores); precision=bf16 to choose otherwise")


def register_resolver() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, auto_precision)

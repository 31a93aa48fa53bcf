"""precision=auto: the fastest precision for the machine the job runs on, chosen when the config is composed.

On a GPU with bf16 (compute capability 8.0 or newer: A100, H100, H200, RTX 30xx on) that is a bf16
compute copy without loss scaling: bf16 has fp32's range, so there is no inf/NaN verdict to read on the
host after each call, and a call whose state all lives on the GPU ends without waiting for it (engine
executor's ``_host_waits``). On an H100 the main job trained at 22,236 images/s in bf16 against 13,911
with the tutorial's fp16 and GradScaler (`END=300 bash bench/gpu_suite.sh cli-bf16`, 2026-12-06, one
invocation, each its own process). Older GPUs get the tutorial's fp16 with a GradScaler. On a CPU, fp16
arithmetic is emulated (the README's ResNet example ran 100x slower than fp32), and bf16 was slower than
fp32 too on the CPU we measured (2 AVX2 cores, no native bf16: a ResNet-34 step 25x, a llama_tiny step
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
    bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    values = {"compute_dtype": "bfloat16" if bf16 else "float16" if cuda else "float32", "grad_scaler": cuda and not bf16}
    return values[key]


def describe() -> str:
    """The one line printed at the start of a precision=auto run: what was chosen and why."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
        return ("precision=auto: bfloat16 compute, no loss scaling, fp32 master weights (this GPU has bf16); "
                "precision=fp16 for the tutorial's fp16 with a GradScaler")
    if torch.cuda.is_available():
        return "precision=auto: float16 compute with a GradScaler, fp32 master weights (this GPU has no native bf16)"
    return ("precision=auto: float32 compute (no CUDA device; on a CPU fp16 is emulated and bf16 measured 2.5-25x "
            "slower than fp32 on 2 AVX2 cores); precision=bf16 to choose otherwise")


def register_resolver() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, auto_precision)

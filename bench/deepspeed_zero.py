"""DeepSpeed peers of bench/llm.py (``--impl deepspeed``): ZeRO-Offload and ZeRO-3 partial offload.

deepspeed_zero2: ZeRO stage 2, the whole optimizer on the CPU (``offload_optimizer.device=cpu``: the fp32
                 master, both moments and the step live on the host, run by DeepSpeedCPUAdam; the GPU
                 keeps the bf16 weights and gradients). DeepSpeed's ZeRO-Offload.
deepspeed_zero3: ZeRO stage 3 with ``offload_optimizer.ratio``: that share of the optimizer state (and
                 its step) on the CPU, the rest on the GPU, the ratio chosen from the GPU's free memory
                 (``choose_ratio``; ``--ds-ratio`` overrides it).
Both: bf16, AdamW (lr 1e-4, weight decay 0.01), the same model, tokens and loss as the other
implementations. DeepSpeed is a benchmark requirement only (bench/README.md), imported when one runs;
on a machine without CUDA it runs on its CPU accelerator (slowly: its C++ ops build at first use).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

SETTINGS = {"deepspeed_zero2": 2, "deepspeed_zero3": 3}
# ZeRO-3 places the optimizer state in sub-groups of this many parameters, the first (1 - ratio) of them
# on the GPU: 1e8 gives steps of ~3% at 3 B parameters (DeepSpeed's default, 1e9, only ~30%).
SUB_GROUP = 100_000_000
GPU_STATE_BYTES = 16  # a parameter of the GPU's share: fp32 master, two fp32 moments, fp32 gradient
RATIO_STEP = 0.05


def config(setting: str, micro_batch: int, ratio: Optional[float] = None) -> dict[str, Any]:
    """The DeepSpeed config of ``setting`` (a key of SETTINGS) for one process."""
    stage = SETTINGS[setting]
    offload: dict[str, Any] = {"device": "cpu", "pin_memory": True}
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": offload, "contiguous_gradients": True, "overlap_comm": True}
    if stage == 3:
        offload["ratio"] = 1.0 if ratio is None else ratio
        zero["sub_group_size"] = SUB_GROUP
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def activation_bytes(hidden: int, intermediate: int, layers: int, vocab: int, tokens: int, loss_chunk: int, checkpoint: bool) -> int:
    """A rough bound on the GPU memory the activations take, bf16. The loss runs over chunks of
    ``loss_chunk`` tokens, each holding bf16 and fp32 logits and their fp32 gradient (12 x vocab bytes
    a token). Per token, with checkpointing every block keeps its input (2 x hidden bytes) and one
    block at a time its whole graph; without, every block keeps its graph, taken as 2 bytes x
    (16 x hidden + 5 x intermediate): plain PyTorch at llama_3b, 4 x 4096 without checkpointing
    peaked at 122.7 GiB on the H200, ~75 GiB of it activations (bench/README.md), i.e. ~170 KB a
    token and block for hidden 3072, intermediate 8192."""
    graph = 2 * (16 * hidden + 5 * intermediate)
    blocks = (2 * hidden * layers + graph if checkpoint else graph * layers) * tokens
    return blocks + 12 * vocab * min(tokens, loss_chunk)


def choose_ratio(params: int, free: int, activations: int) -> float:
    """The share of the optimizer state to offload: the least, in steps of RATIO_STEP, that leaves
    the GPU room for the bf16 weights and gradients (4 bytes a parameter), the activations and a
    reserve of max(8 GiB, 10% of what is free): allocator slack, the kernels' workspaces and
    DeepSpeed's buckets (a 5e8-element reduce bucket, up to 1e9 live gathered parameters)."""
    room = free - 4 * params - activations - max(8 * 2**30, free // 10)
    on_gpu = min(max(room / (GPU_STATE_BYTES * params), 0.0), 1.0)
    steps = int(on_gpu / RATIO_STEP + 1e-9)
    return round(1.0 - steps * RATIO_STEP, 4)


class WouldNotFit(Exception):
    """ZeRO's own accounting says this configuration runs out of memory: a result, reported before the build
    (a host out of memory would bring the operating system's killer, not an error)."""


def check_fits(params: int, ratio: float, gpu_free: int, activations: int, host_available: int) -> None:
    """Raise WouldNotFit where the GPU cannot hold the bf16 weights and gradients (4 bytes a parameter), the
    activations and the optimizer state not offloaded, or the host the offloaded share (GPU_STATE_BYTES a
    parameter: DeepSpeedCPUAdam's fp32 master, moments and gradients)."""
    gpu = 4 * params + activations + (1 - ratio) * GPU_STATE_BYTES * params
    host = ratio * GPU_STATE_BYTES * params
    if gpu > gpu_free or host > host_available:
        raise WouldNotFit(f"offload ratio {ratio}: GPU {gpu / 2**30:.1f} GiB of {gpu_free / 2**30:.1f} free, "
                          f"host {host / 2**30:.1f} GiB of {host_available / 2**30:.1f} available")


def engine_step(model: torch.nn.Module, ds_config: dict, batch: tuple, device: str, normalizer: int) -> tuple[Callable[[], torch.Tensor], Any]:
    """(one training step, the engine) for ``model`` under ``ds_config``; one process of world size 1."""
    import deepspeed

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534")):
        os.environ.setdefault(key, value)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
    x, y = batch

    def step() -> torch.Tensor:
        loss = engine((x.to(device, non_blocking=True), y.to(device, non_blocking=True))) / normalizer
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine

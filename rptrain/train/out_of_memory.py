"""A GPU out of memory during a run: one line with torch's numbers and the settings that lower the need.

torch's message spans several sentences (every process on the GPU, the allocator's reserve, a pointer to its
documentation); the line keeps what was asked for and what was free, then names the run's own levers.
"""
from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from .errors import OutOfGpuMemory, one_line
from .model import IMAGE, model_kind
from .validate import num_microbatch

_KEPT = ("Tried to allocate", "GPU")  # torch's sentences with the request and the card's capacity and free memory


def out_of_gpu_memory(err: BaseException, cfg: DictConfig, step: Optional[int], kept: str, gpus: int) -> OutOfGpuMemory:
    """The error the CLI prints for ``err`` (a torch.OutOfMemoryError) at ``step`` (None: before the first step)."""
    sentences = [part.rstrip(".") for part in one_line(err).split(". ")]
    numbers = "; ".join(part for part in sentences if part.startswith(_KEPT)) or sentences[0]
    where = f"at step {step + 1}" if step is not None else "before the first step"
    image = model_kind(cfg.model) == IMAGE
    length = next((f"data.{key}" for key in ("seq_len", "max_seq_len") if key in cfg.data), None)  # text / chat
    levers = ["lower trainer.batch_size" + (f" or {length}" if length else "")]
    # Only convolution models' layers are traced as joinable (engine/fusion.py); a decoder's microbatches run apart anyway.
    microbatches = num_microbatch(cfg)
    if image and microbatches > 1 and gpus == 1 and cfg.engine.fuse_microbatches:
        levers.append(f"engine.fuse_microbatches=false (the {microbatches} microbatches then run apart, "
                      "each with only its own activations)")
    levers.append("engine.max_gpu_memory below the free memory, so the engine plans for less")
    return OutOfGpuMemory(f"out of GPU memory {where} ({numbers}): {', or '.join(levers)}; {kept}")

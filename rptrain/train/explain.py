"""`rptrain --explain`: what one training call of a config would do, printed before a long run.

It builds the config's data, model and engine as a run would (one process), takes the first
training batch as the example inputs and prints the engine's plan and the action list of one call
(`RoundPipe.explain`): stages, residency, transfers and their bytes. Nothing trains, nothing is
written, no run directory is made.
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig


from .dist import Dist
from .setup import build_data_and_model, build_engine
from .tasks import make_task
from .validate import check_inputs, num_microbatch, validate_config


def explain_config(cfg: DictConfig) -> str:
    validate_config(cfg)
    check_inputs(cfg)  # a missing data set is one line, as before a run
    dtype, data, model, maker = build_data_and_model(cfg)
    num_layers = len(model)
    engine = build_engine(cfg, model, Dist(), maker)
    del model, maker
    try:
        batches = data.train.epoch(0, 0)
        try:
            batch = next(batches)
        finally:
            batches.close()
        inputs = make_task(data.kind, num_microbatch(cfg), dtype).inputs(batch)
        head = f"model {cfg.model.name}: {num_layers} layers; one training call on inputs {shapes(inputs)}"
        return f"{head}\n{engine.explain(*inputs)}"
    finally:
        engine.close()


def shapes(value: Any) -> str:
    """A batch's structure with tensors as dtype[shape]: `(float32[16, 3, 32, 32],)`."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(map(str, value.shape))}]"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(shapes(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


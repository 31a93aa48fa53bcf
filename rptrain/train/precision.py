"""Precision settings -> torch dtypes and the GradScaler."""
from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from rptrain import GradScaler

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def torch_dtype(value: object) -> torch.dtype:
    """A schema Dtype (or its name) as a torch.dtype."""
    return _DTYPES[getattr(value, "value", value)]


def build_scaler(precision: DictConfig) -> GradScaler:
    """precision.grad_scaler maps one-to-one onto GradScaler's arguments; disabled, it is a no-op."""
    return instantiate(precision.grad_scaler)

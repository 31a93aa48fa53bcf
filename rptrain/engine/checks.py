"""Argument checks of ``RoundPipe``: one clear error naming the argument and what it takes."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .batching import PackedData
from .config import RoundPipeRunConfig
from .tuning import Tuning


def check_args(model: Any, optim_dtype: Any, model_run_config: Any, cuda_graphs: Any, pin_model: Any, tuning: Any,
                optimizer_threads: Any, materialise: Any = None, single_version: Any = None) -> None:
    if pin_model not in ("alloc", "register", "off"):
        raise ValueError(f"pin_model must be 'alloc', 'register' or 'off', got {pin_model!r}")
    if tuning is not None and not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be a rptrain.engine.tuning.Tuning, got {type(tuning).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"RoundPipe needs an nn.Module (an nn.Sequential is split into its elements), got {type(model).__name__}")
    if isinstance(model, nn.Sequential) and len(model) == 0:
        raise ValueError("RoundPipe needs a non-empty nn.Sequential")
    if not (isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point):
        raise TypeError(f"optim_dtype must be a floating-point torch.dtype, got {optim_dtype!r}")
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if model_run_config is not None and not isinstance(model_run_config, RoundPipeRunConfig):
        raise TypeError(f"model_run_config must be a RoundPipeRunConfig, got {type(model_run_config).__name__}")
    if optimizer_threads is not None and (not isinstance(optimizer_threads, int) or optimizer_threads < 1):
        raise ValueError(f"optimizer_threads must be a positive int, got {optimizer_threads!r}")
    if single_version is not None and not isinstance(single_version, bool):
        raise TypeError(f"single_version must be True, False or None, got {single_version!r}")
    if materialise is not None and not callable(materialise):
        raise TypeError(f"materialise must be a function of a layer's index, got {type(materialise).__name__}")
    home = "meta" if materialise is not None else "cpu"
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != home:
            where = "on the meta device (materialise makes it real)" if materialise is not None else "on the CPU"
            raise ValueError(f"RoundPipe takes a model {where}; {name!r} is on {t.device}")


def check_inputs(input_args: Any, input_kwargs: Optional[dict]) -> tuple[tuple, dict]:
    if isinstance(input_args, Tensor):
        input_args = (input_args,)
    if not isinstance(input_args, (tuple, list)):
        raise TypeError(f"input_args must be a tuple of the first layer's positional inputs, got {type(input_args).__name__}")
    if input_kwargs is None:
        input_kwargs = {}
    if not isinstance(input_kwargs, dict):
        raise TypeError(f"input_kwargs must be a dict, got {type(input_kwargs).__name__}")
    if not any(isinstance(leaf, (Tensor, PackedData)) for leaf in pytree.tree_leaves((input_args, input_kwargs))):
        raise ValueError("forward_backward got no input tensors")
    return tuple(input_args), dict(input_kwargs)


def check_state_dict(state_dict: dict, targets: dict, strict: bool) -> tuple[list, list]:
    """(missing keys, unexpected keys); an error for a strict mismatch, a non-tensor or a wrong shape."""
    missing = [k for k in targets if k not in state_dict]
    unexpected = [k for k in state_dict if k not in targets]
    if strict and (missing or unexpected):
        raise KeyError(f"load_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                       f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for key, value in state_dict.items():
        if key in targets:
            if not isinstance(value, Tensor):
                raise TypeError(f"load_state_dict: {key!r} is a {type(value).__name__}, expected a tensor")
            if value.shape != targets[key].shape:
                raise ValueError(f"load_state_dict: {key!r} has shape {tuple(value.shape)}, the model expects {tuple(targets[key].shape)}")
    return missing, unexpected

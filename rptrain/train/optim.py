"""The optimizer of a run from ``cfg.optim``: the engine's master dtype, what the optimizer's state costs
(the engine's fit check counts it before the optimizer exists) and the optimizer itself."""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from rptrain.optim.state import OptimizerMemory, state_memory_of

from .errors import ConfigError

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def master_dtype(optim: DictConfig) -> torch.dtype:
    return MASTER_DTYPES[_value(optim.master_dtype)]


def _value(x: Any) -> str:
    return getattr(x, "value", x)


def _state_kwargs(optim: DictConfig) -> dict:
    """``state_dtype`` and ``compile_step`` for the optimizer's constructor; nothing with an fp32 master and
    state, so any torch optimizer builds."""
    if _value(optim.master_dtype) == "fp32" and _value(optim.state_dtype) == "fp32":
        return {}
    return {"state_dtype": _value(optim.state_dtype), "compile_step": optim.compile_step}


def check_optim_dtypes(optim: DictConfig) -> None:
    """A bf16 master or low-precision state needs an optimizer that implements them (takes ``state_dtype``)."""
    if _value(optim.master_dtype) == "fp32" and _value(optim.state_dtype) == "fp32":
        return
    target = optim.optimizer._target_
    try:
        takes = "state_dtype" in inspect.signature(get_class(target)).parameters
    except Exception:  # an unimportable target is reported where it is built
        return
    if not takes:
        raise ConfigError(f"optim.master_dtype={_value(optim.master_dtype)} optim.state_dtype={_value(optim.state_dtype)}: "
                          f"{target} does not implement a bf16 master or low-precision state; use rptrain.optim.Adam or AdamW "
                          f"(optim=adamw_lowmem), or optim.master_dtype=fp32 optim.state_dtype=fp32")


def optimizer_memory(optim: DictConfig) -> OptimizerMemory:
    kwargs = {k: v for k, v in OmegaConf.to_container(optim.optimizer, resolve=True).items() if k != "_target_"}
    return state_memory_of(optim.optimizer._target_, master_dtype(optim), **kwargs, **_state_kwargs(optim))


def build_optimizer(optim: DictConfig, params: Iterable) -> torch.optim.Optimizer:
    return instantiate(optim.optimizer, params=params, _convert_="all", **_state_kwargs(optim))

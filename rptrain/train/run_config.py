"""The run_config group -> rptrain.RoundPipeRunConfig."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

from omegaconf import DictConfig

from rptrain import ExecutePlan, RoundPipe, RoundPipeRunConfig

from . import dist
from .errors import ConfigError, one_line

CALLABLE_FIELDS = ("split_input", "split_label", "merge_output")


def _import_callable(key: str, path: Optional[str]) -> Optional[Callable]:
    if path is None:
        return None
    module, _, name = path.replace(":", ".").rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"run_config.{key}={path} cannot be imported ({one_line(err)}): give module.function of an importable callable") from err
    if not callable(obj):
        raise ConfigError(f"run_config.{key}={path} is a {type(obj).__name__}, not a callable")
    return obj


def default_num_microbatch() -> int:
    """The engine's num_microbatch when run_config sets none, for the devices this process's engine
    gets (dist.py: under torchrun a share of the machine's GPUs, or the one GPU a rank sees)."""
    world, local_world = dist.world_size(), max(dist.env_int("LOCAL_WORLD_SIZE", 1), 1)
    devices = dist.local_devices(dist.local_rank(), local_world) if world > 1 else None
    return RoundPipe.default_num_microbatch(devices)


def build_run_config(cfg: DictConfig, num_layers: int, num_microbatch: Optional[int] = None) -> RoundPipeRunConfig:
    """Every field of cfg (the run_config group) as RoundPipeRunConfig, with errors as ConfigError;
    ``num_microbatch``: the run's resolved count (validate.num_microbatch) where cfg leaves it null."""
    kwargs: dict[str, Any] = {
        "num_microbatch": cfg.num_microbatch or num_microbatch,
        "requires_grad": cfg.requires_grad,
        "output_device": cfg.output_device,
        "preserve_rng_state": cfg.preserve_rng_state,
        "recompute_grain": None if cfg.recompute_grain is None else cfg.recompute_grain.value,
    }
    for key in CALLABLE_FIELDS:
        kwargs[key] = _import_callable(key, cfg[key])
    plan = cfg.execute_plan
    try:
        if plan.forward is not None or plan.backward is not None:
            backward = None if plan.backward is None else list(plan.backward)
            kwargs["execute_plan"] = ExecutePlan.from_cuts(num_layers, list(plan.forward or []), backward)
            kwargs["execute_plan"].check_layers(num_layers)
        return RoundPipeRunConfig(**kwargs)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"run_config: {one_line(err)}") from err

"""model.lora in a run: adapters on the built model (rank 0 = full fine-tuning) and the export
of a LoRA run, merged into the base weights (RUN_DIR/hf, default) or the adapters alone in PEFT's
format (RUN_DIR/adapter)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig
from torch import nn

from rptrain.models.lora import apply_lora, merged_state
from rptrain.models.lora_export import save_adapter

from .errors import ConfigError


def with_lora(model: nn.Sequential, lora: Optional[dict]) -> nn.Sequential:
    if not lora or lora["rank"] == 0:
        return model
    if lora["rank"] < 0 or lora["alpha"] <= 0 or not 0 <= lora["dropout"] < 1:
        raise ConfigError(f"model.lora: rank={lora['rank']} alpha={lora['alpha']} dropout={lora['dropout']}: "
                          "rank must be >= 0, alpha > 0 and dropout in [0, 1)")
    try:
        return apply_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["targets"], bool(lora.get("train_router", False)))
    except ValueError as err:
        raise ConfigError(f"{err}: fix model.lora.targets") from err


def lora_rank(cfg: DictConfig) -> int:
    lora = cfg.model.get("lora")
    return lora.rank if lora is not None else 0


def merged(cfg: DictConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A run's state with its adapters folded in (itself when the run is not LoRA)."""
    if not lora_rank(cfg):
        return state
    return merged_state(state, cfg.model.lora.alpha / cfg.model.lora.rank)


def wants_adapter(cfg: DictConfig) -> bool:
    return lora_rank(cfg) > 0 and cfg.model.lora.export.name == "adapter"


def export_adapter(cfg: DictConfig, model: nn.Sequential, state: dict[str, torch.Tensor], run_dir: Path) -> Path:
    base = cfg.model.get("path") or cfg.model.get("weights")
    return save_adapter(model, Path(run_dir) / "adapter", state=state, base_model=str(base) if base else None)

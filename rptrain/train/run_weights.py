"""A finished run as a source of weights: its directory or its checkpoints/last.pt.

`model.weights=RUN_DIR` seeds a new run (any other data, optimizer or schedule) with a run's trained
weights, and `rptrain-export` reads the same checkpoints. Only the master weights are taken; the
optimizer state, step and data position stay behind (that is trainer.resume's job).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import yaml
from omegaconf import DictConfig
from torch import nn

from .checkpoint import LAST, is_checkpoint, load_checkpoint
from .errors import CheckpointError, one_line
from .lora import merged
from .stored_config import checked_config


def run_checkpoint(path: str | Path) -> Optional[Path]:
    """The rptrain checkpoint `path` names (a run directory, or a checkpoint file), else None."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = p / "checkpoints" / LAST
        return found if found.is_file() else None
    # Anything else is not ours to judge: the plain weight loader reports it.
    return p if p.is_file() and p.suffix == ".pt" and is_checkpoint(p) else None


def run_config(checkpoint: Path, state: dict) -> DictConfig:
    """The config a checkpoint was written with: stored in it, else its run's .hydra/config.yaml;
    checked against the schema (stored_config.py: a file never names code to run)."""
    if state.get("config"):
        return checked_config(state["config"], f"checkpoint {checkpoint}")
    saved = checkpoint.parent.parent / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} holds no config and {saved} is missing: export from the run directory it was written in")
    try:
        raw = yaml.safe_load(saved.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise CheckpointError(f"{saved} cannot be read ({one_line(err)[:200]}): export from the checkpoint of an intact run") from err
    return checked_config(raw, str(saved))


def check_same_model(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """The checkpoint's tensors are exactly the model's: the same names and shapes."""
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    found = {k: tuple(t.shape) for k, t in weights.items()}
    if expected == found:
        return
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    shapes = [f"{k} {found[k]} vs {expected[k]}" for k in expected.keys() & found.keys() if found[k] != expected[k]]
    detail = "; ".join(part for part in (
        f"missing {len(missing)} ({', '.join(missing[:3])})" if missing else "",
        f"unexpected {len(extra)} ({', '.join(extra[:3])})" if extra else "",
        f"other shapes ({', '.join(sorted(shapes)[:3])})" if shapes else "") if part)
    raise CheckpointError(f"{source} was written for another model ({detail}): use the model config that run trained")


def load_run_weights(model: nn.Module, checkpoint: Path, key: str = "model.weights") -> None:
    """Copy a run checkpoint's master weights into `model` (cast to its dtype); on the meta device only check them."""
    source = f"{key}={checkpoint}"
    try:
        state = load_checkpoint(checkpoint)
    except CheckpointError as err:
        raise CheckpointError(f"{key}: {one_line(err)}") from err
    weights = merged(run_config(checkpoint, state), state["model"])  # a LoRA run seeds with its adapters folded in
    check_same_model(model, weights, source)
    if not any(t.is_meta for t in model.state_dict().values()):
        model.load_state_dict(weights)

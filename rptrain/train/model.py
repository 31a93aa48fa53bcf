"""The model group -> an nn.Sequential, plus the fingerprint that ties checkpoints to a model.

Model configs map one-to-one onto rptrain.models.build_model(name, **kwargs); the trainer adds
what only it knows: the dtype, the device (meta for dry runs) and, for language models without a
model.vocab_size, the data's vocabulary size.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from rptrain.models import HFModelError, load_weights
from rptrain.models import build_model as build_registered

from .errors import ConfigError, one_line
from .lora import with_lora
from .run_weights import load_run_weights, run_checkpoint

IMAGE, LM = "image", "lm"
BUILDER = "rptrain.models.build_model"  # the one _target_ a model config may name
# Which data each kind of model trains on (the data group's `name`).
DATA_FOR = {IMAGE: ("cifar100", "cifar10", "synthetic"), LM: ("text", "synthetic_tokens", "chat")}


def model_kind(model_cfg: DictConfig) -> str:
    """'lm' for the decoders (they take (ids, targets) and return the loss), else 'image'."""
    return LM if "vocab_size" in model_cfg or model_cfg.get("name") == "hf" else IMAGE


def data_kind(data_cfg: DictConfig) -> str:
    return next(kind for kind, names in DATA_FOR.items() if data_cfg.name in names)


def build_model(cfg: DictConfig, dtype: torch.dtype, device: Any = None, vocab_size: Optional[int] = None) -> nn.Sequential:
    """Build cfg.model; `vocab_size` fills in a language model's null model.vocab_size."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    weights = model_cfg.pop("weights", None)
    lora = model_cfg.pop("lora", None)
    if model_kind(cfg.model) == LM and model_cfg.get("vocab_size") is None:
        model_cfg["vocab_size"] = vocab_size
    # The registry by name, never Hydra's instantiate: a config read back from a file is data (stored_config.py).
    if model_cfg.pop("_target_", BUILDER) != BUILDER:
        raise ConfigError(f"model._target_={cfg.model.get('_target_')!r}: models are built by {BUILDER}; leave model._target_ out")
    try:
        model = build_registered(**model_cfg, dtype=dtype, device=device)
    except Exception as err:  # the builders raise ValueError for inconsistent shapes
        cause = err.__cause__ or err
        if isinstance(cause, HFModelError):  # names the file and field itself
            raise ConfigError(one_line(cause)) from err
        raise ConfigError(f"model={cfg.model.name}: {one_line(cause)}: fix the model.* values") from err
    limit, seq_len = getattr(model[0], "max_seq_len", None), cfg.data.get("seq_len") or cfg.data.get("max_seq_len")
    if cfg.model.get("max_seq_len", 0) is None and limit is not None and seq_len is not None and seq_len > limit:
        raise ConfigError(f"data.seq_len={seq_len} is longer than {cfg.model.path}'s {limit} positions: "
                          f"lower data.seq_len, or set model.max_seq_len to train longer anyway")
    if weights is not None and (checkpoint := run_checkpoint(weights)) is not None:
        load_run_weights(model, checkpoint)  # a finished run seeds this one (checked on meta too: preflight)
    elif weights is not None and device != "meta":
        try:
            load_weights(model, weights)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            raise ConfigError(f"model.weights={weights} cannot be loaded ({one_line(err)}): point it at a checkpoint of this model") from err
    return with_lora(model, lora)


def fingerprint(model_name: str, model: nn.Module) -> dict:
    """What a checkpoint must match: names and shapes of every parameter and buffer."""
    entries = [f"{k}:{tuple(t.shape)}" for k, t in model.state_dict().items()]
    return {
        "model": model_name,
        "params": sum(p.numel() for p in model.parameters()),
        "shapes": hashlib.sha1("\n".join(entries).encode()).hexdigest()[:16],
    }

"""Which tokenizer a text run uses: data.tokenizer, or (null) the model's own.

    byte                      the built-in byte tokenizer
    PATH                      a tokenizer.json, or a folder holding one (tokenizer_config.json next to it is read too)
    null                      model=hf: the tokenizer in model.path; any other model: byte
"""
from __future__ import annotations

from omegaconf import DictConfig

from rptrain.data import Tokenizer, get_tokenizer


def tokenizer_source(cfg: DictConfig) -> str:
    if cfg.data.get("tokenizer") is not None:
        return str(cfg.data.tokenizer)
    return str(cfg.model.path) if cfg.model.get("path") else "byte"


def build_tokenizer(cfg: DictConfig) -> Tokenizer:
    return get_tokenizer(tokenizer_source(cfg), cfg.data.get("eos_token"))

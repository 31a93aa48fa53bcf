"""A language-model run's weights -> a Hugging Face folder of the same architecture.

Every run of `model=hf` or of a Llama/Qwen3 preset writes `hf/` in its run directory at the end
(trainer.hf_export), and `rptrain-export` does the same for any checkpoint. The config.json is:
  model=hf        the source folder's config.json (its generation_config.json is kept too);
  llama_*         a LlamaForCausalLM config from the preset's fields;
  qwen3_*         the Qwen3ForCausalLM config.json the preset mirrors, with the run's overrides;
the vocabulary size is the trained embedding's and the token ids are the run's tokenizer's.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from rptrain.data.byte_tokenizer_files import write_byte_tokenizer
from rptrain.models import LLAMA_PRESETS, LlamaConfig
from rptrain.models.hf_export import hf_export
from rptrain.models.hf_presets import PRESETS, llama_hf_config, preset_json

from .chat_export import write_chat_template
from .errors import USER_ERRORS, ConfigError, one_line
from .lora import lora_rank, merged
from .tokenizer import build_tokenizer, tokenizer_source

EMBEDDING = "0.embed_tokens.weight"


def exportable(cfg: DictConfig) -> bool:
    m = cfg.model
    return bool(m.get("path")) or m.name in LLAMA_PRESETS or m.name in PRESETS


def _source_json(cfg: DictConfig, name: str) -> Optional[dict]:
    """A file of model=hf's source folder (None when the folder has no such file)."""
    path = Path(cfg.model.path).expanduser() / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"model.path: {path} cannot be read ({type(err).__name__}): restore the model folder the run trained") from err


def _token_ids(cfg: DictConfig) -> dict:
    if cfg.data.name not in ("text", "chat"):
        return {}
    tok = build_tokenizer(cfg)
    ids = dict(bos_token_id=getattr(tok, "bos_id", None), eos_token_id=tok.eos_id, pad_token_id=getattr(tok, "pad_id", None))
    return {k: v for k, v in ids.items() if v is not None}


def hf_config(cfg: DictConfig, vocab_size: int) -> dict:
    """The config.json for a run's model, with the trained vocabulary size."""
    m = OmegaConf.to_container(cfg.model, resolve=True)
    if m.get("path"):
        config = _source_json(cfg, "config.json")
        if config is None:
            raise ConfigError(f"model.path={m['path']} has no config.json any more: restore the model folder the run trained")
        return config
    if m["name"] in LLAMA_PRESETS:
        fields = {f.name for f in dataclasses.fields(LlamaConfig)}
        config = llama_hf_config(LlamaConfig(**{k: v for k, v in m.items() if k in fields and k != "vocab_size"}, vocab_size=vocab_size))
    elif m["name"] in PRESETS:
        config = {**preset_json(m["name"], **{k: v for k, v in m.items() if k in PRESETS[m["name"]]}), "vocab_size": vocab_size,
                  "max_position_embeddings": m["max_seq_len"], "initializer_range": m["init_std"]}
    else:
        raise ConfigError(f"model={m['name']} has no Hugging Face architecture: only language models (model=hf, llama_*, qwen3_*) export")
    return {**config, **_token_ids(cfg)}


def export_weights(cfg: DictConfig, state: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype) -> Path:
    """Write `state` (the run's Sequential names) as a Hugging Face folder in `dtype`."""
    state = merged(cfg, state)  # a LoRA run: adapters folded into the base weights
    if EMBEDDING not in state:
        raise ConfigError(f"the weights of model={cfg.model.name} have no {EMBEDDING}: not a decoder this rptrain exports")
    config = hf_config(cfg, int(state[EMBEDDING].shape[0]))
    generation = _source_json(cfg, "generation_config.json") if cfg.model.get("path") else None
    tokenizer = tokenizer_source(cfg) if cfg.data.name in ("text", "chat") or cfg.model.get("path") else None
    out = hf_export(state, config, out_dir, dtype=dtype, tokenizer=tokenizer, generation_config=generation)
    if tokenizer == "byte":
        write_byte_tokenizer(out)
    if cfg.data.name == "chat":  # the template trained with, also when it was the ChatML fallback
        from .data import chat_template

        write_chat_template(out, chat_template(cfg))
    return out


def export_run(cfg: DictConfig, engine: Any, run_dir: Path, dtype: torch.dtype) -> Path:
    """The end of a run: RUN_DIR/hf, written from the engine's master weights where they live (a GPU
    share's a chunk at a time: no host copy of them). A LoRA run folds its adapters into the host's
    frozen base, so its (small) trainable state comes to the host first. A failure names the way to
    retry (the checkpoint is written by then)."""
    state = engine.state_dict() if lora_rank(cfg) else engine.master_state()
    try:
        return export_weights(cfg, state, Path(run_dir) / "hf", dtype)
    except USER_ERRORS as err:
        raise ConfigError(f"{one_line(err)} (the checkpoint is saved: after fixing, run rptrain-export {run_dir} OUT_DIR)") from err

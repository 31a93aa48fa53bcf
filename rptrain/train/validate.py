"""Checks of a composed config that its schema cannot express.

`validate_config` looks only at values (cheap, no I/O) and runs for every job of a sweep before
the first one starts; `check_inputs` looks at the files a run needs (dataset, corpus, output
directory). Both raise ConfigError / DataError with one line naming the key and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from rptrain.data import DataError
from rptrain.engine.fit import parse_size
from rptrain.models.hf_presets import MOE_PRESETS, QWEN3_PRESETS

from . import dist, schema
from .errors import ConfigError
from .optim import check_optim_dtypes
from .model import DATA_FOR, IMAGE, LM, data_kind, model_kind
from .run_config import default_num_microbatch


def default_microbatches() -> int:
    """The engine's default num_microbatch for this process's devices (asked of the engine)."""
    return default_num_microbatch()


def num_microbatch(cfg: DictConfig) -> int:
    """run_config.num_microbatch; null: 1 for an image model on one GPU or the CPU, else the engine's default (GPUs + 1).
    Microbatches let transfers overlap compute; an image model and its state stay on the GPU, where splitting the
    batch only makes smaller kernels (and BatchNorm statistics of half a batch): ResNet-34 in bf16 on an H100 took
    3.62 ms a step with one microbatch against 6.11 with two, plain PyTorch graphed 3.36 (one invocation, 2026-12-06)."""
    if cfg.run_config.num_microbatch:
        return cfg.run_config.num_microbatch
    engine_default = default_microbatches()
    return 1 if model_kind(cfg.model) == IMAGE and engine_default <= 2 else engine_default


def _positive(key: str, value: Optional[int], allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer{' or null' if allow_none else ''}")


DATA_SCHEMAS = {
    "cifar10": schema.CifarDataConfig,
    "cifar100": schema.CifarDataConfig,
    "synthetic": schema.SyntheticImagesConfig,
    "text": schema.TextDataConfig,
    "synthetic_tokens": schema.SyntheticTokensConfig,
    "chat": schema.ChatDataConfig,
}


def _known_keys(node: DictConfig, cls: type, prefix: str) -> None:
    """Keys added with +key=value are not in the schema: refuse them rather than ignore them."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in node:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{prefix}{key} is not a config key{hint}: remove it; `rptrain --cfg job` prints every key")
        sub = node._get_node(key)
        target = fields[key].type
        nested = getattr(schema, target, None) if isinstance(target, str) else target
        if isinstance(sub, DictConfig) and dataclasses.is_dataclass(nested) and not sub._is_none():
            _known_keys(sub, nested, f"{prefix}{key}.")


def _model_schema(model_cfg: DictConfig) -> type:
    if model_cfg.get("name") == "hf":
        return schema.HFModelConfig
    if model_kind(model_cfg) != LM:
        return schema.ResNetConfig
    if model_cfg.name in MOE_PRESETS:
        return schema.MoeModelConfig
    return schema.Qwen3ModelConfig if model_cfg.name in QWEN3_PRESETS else schema.LlamaModelConfig


def check_known_keys(cfg: DictConfig) -> None:
    _known_keys(cfg, schema.RPTrainConfig, "")
    _known_keys(cfg.model, _model_schema(cfg.model), "model.")
    _known_keys(cfg.data, DATA_SCHEMAS[cfg.data.name], "data.")


def validate_config(cfg: DictConfig) -> None:
    if cfg.data.name not in DATA_SCHEMAS:
        raise ConfigError(f"data.name={cfg.data.name} is not a data set rptrain knows: choose data={'|'.join(DATA_SCHEMAS)}")
    check_known_keys(cfg)
    kind = model_kind(cfg.model)
    if data_kind(cfg.data) != kind:
        wanted = "|".join(DATA_FOR[kind])
        what = "images" if kind == IMAGE else "token sequences"
        raise ConfigError(f"model={cfg.model.name} trains on {what} but data={cfg.data.name}: use data={wanted}")
    _missing_values(cfg)
    t = cfg.trainer
    _positive("trainer.epochs", t.epochs, allow_none=False)
    _positive("trainer.batch_size", t.batch_size, allow_none=False)
    _positive("trainer.log_interval", t.log_interval, allow_none=False)
    for key in ("max_steps", "eval_batch_size", "eval_num_microbatch", "eval_interval", "checkpoint_interval"):
        _positive(f"trainer.{key}", t[key])
    _positive("trainer.keep_checkpoints", t.keep_checkpoints, allow_none=False)
    _positive("trainer.sample_max_tokens", t.sample_max_tokens, allow_none=False)
    if t.sample_temperature < 0:
        raise ConfigError(f"trainer.sample_temperature={t.sample_temperature} must be >= 0 (0: greedy)")
    if t.num_workers < 0:
        raise ConfigError(f"trainer.num_workers={t.num_workers} must be >= 0")
    micro = cfg.run_config.num_microbatch
    _positive("run_config.num_microbatch", micro)
    micro = num_microbatch(cfg)
    source = "run_config.num_microbatch" if cfg.run_config.num_microbatch else f"the default num_microbatch ({micro})"
    _positive("engine.optimizer_threads", cfg.engine.optimizer_threads)
    _positive("engine.threads", cfg.engine.threads)
    for key in ("max_host_memory", "max_gpu_memory"):
        try:
            parse_size(cfg.engine[key], f"engine.{key}")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if not cfg.dist.timeout_s > 0:
        raise ConfigError(f"dist.timeout_s={cfg.dist.timeout_s} must be > 0 seconds")
    world = dist.world_size()
    if world == 1 and t.batch_size < micro:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} is smaller than {source}={micro}: every microbatch needs a sample; "
            f"raise trainer.batch_size or lower run_config.num_microbatch"
        )
    if world > 1:
        _validate_dist(cfg, world, micro, source)
    _validate_optim(cfg.optim)
    _validate_scaler(cfg.precision.grad_scaler)
    if kind == LM:
        _validate_lm(cfg)
    else:
        _validate_images(cfg)


def local_batch(cfg: DictConfig) -> int:
    """Each rank's share of the global batch trainer.batch_size."""
    return cfg.trainer.batch_size // dist.world_size()


def _validate_dist(cfg: DictConfig, world: int, micro: int, source: str) -> None:
    b = cfg.trainer.batch_size
    if b % world:
        raise ConfigError(
            f"trainer.batch_size={b} (the global batch) does not split evenly over {world} ranks (WORLD_SIZE={world}): "
            f"use a multiple of {world}, or another number of processes"
        )
    if b // world < micro:
        raise ConfigError(
            f"trainer.batch_size={b} over {world} ranks gives {b // world} samples per rank, fewer than {source}={micro}: "
            f"raise trainer.batch_size to at least {micro * world} or lower run_config.num_microbatch"
        )
    if cfg.dist.backend.value == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend=nccl needs CUDA GPUs but none is available: use dist.backend=auto or gloo")


def _missing_values(cfg: DictConfig) -> None:
    """A ??? value in the YAML (data.path of data=text) that the command line did not fill in."""
    for key in sorted(OmegaConf.missing_keys(cfg)):
        if key.startswith("hydra."):
            continue
        path = "/path/to/chat.jsonl (a .jsonl/.json/.parquet file or a folder of them)" if cfg.data.name == "chat" else "/path/to/corpus.txt (a text file or a folder of .txt/.md files)"
        example = {"data.path": f"data.path={path}",
                   "model.path": "model.path=/path/to/hf_model (a folder with config.json and *.safetensors)"}.get(key, f"{key}=VALUE")
        raise ConfigError(f"{key} is required for this config: add {example}")


def _validate_optim(optim: DictConfig) -> None:
    check_optim_dtypes(optim)
    o, s = optim.optimizer, optim.schedule
    if not o.lr > 0:
        raise ConfigError(f"optim.optimizer.lr={o.lr} must be > 0")
    if not o.eps >= 0:
        raise ConfigError(f"optim.optimizer.eps={o.eps} must be >= 0 (it keeps Adam's division finite; the default is 1e-8)")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.optimizer.betas={list(o.betas)} must be two numbers in [0, 1)")
    if s.warmup_steps < 0:
        raise ConfigError(f"optim.schedule.warmup_steps={s.warmup_steps} must be >= 0")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    _positive("optim.schedule.decay_steps", s.decay_steps)
    if optim.clip_grad_norm is not None and not optim.clip_grad_norm > 0:
        raise ConfigError(f"optim.clip_grad_norm={optim.clip_grad_norm} must be > 0 or null")


def _validate_scaler(g: DictConfig) -> None:
    if not g.growth_factor > 1:
        raise ConfigError(f"precision.grad_scaler.growth_factor={g.growth_factor} must be > 1 (the scale grows by it after growth_interval clean steps; the default is 2)")
    if not 0 < g.backoff_factor < 1:
        raise ConfigError(f"precision.grad_scaler.backoff_factor={g.backoff_factor} must be in (0, 1) (the scale shrinks by it on an overflow; the default is 0.5)")
    if not g.init_scale > 0:
        raise ConfigError(f"precision.grad_scaler.init_scale={g.init_scale} must be > 0")
    _positive("precision.grad_scaler.growth_interval", g.growth_interval, allow_none=False)


def _validate_images(cfg: DictConfig) -> None:
    d = cfg.data
    if d.augment_device.value == "cuda" and not torch.cuda.is_available():
        raise ConfigError("data.augment_device=cuda but no CUDA device is available: use data.augment_device=auto or cpu")
    if d.name in ("cifar10", "cifar100") and d.num_classes != {"cifar10": 10, "cifar100": 100}[d.name]:
        raise ConfigError(f"data.num_classes={d.num_classes} but {d.name} has {10 if d.name == 'cifar10' else 100} classes: leave data.num_classes alone")
    if len(d.mean) != 3 or len(d.std) != 3 or not all(s > 0 for s in d.std):
        raise ConfigError(f"data.mean={list(d.mean)} / data.std={list(d.std)} need three values each (std > 0)")
    if d.crop_padding < 0:
        raise ConfigError(f"data.crop_padding={d.crop_padding} must be >= 0")
    _positive("data.chunk_batches", d.chunk_batches, allow_none=False)
    if d.name == "synthetic":
        _positive("data.num_train", d.num_train, allow_none=False)
        if d.num_test < 0:
            raise ConfigError(f"data.num_test={d.num_test} must be >= 0")
        _positive("data.num_classes", d.num_classes, allow_none=False)


def _validate_lm(cfg: DictConfig) -> None:
    d, m = cfg.data, cfg.model
    key = "max_seq_len" if d.name == "chat" else "seq_len"
    _positive(f"data.{key}", d[key], allow_none=d.name == "chat")  # chat: null is the model's context
    if m.max_seq_len is not None and d[key] is not None and d[key] > m.max_seq_len:
        raise ConfigError(f"data.{key}={d[key]} is longer than model.max_seq_len={m.max_seq_len}: raise model.max_seq_len or lower data.{key}")
    if d.name == "synthetic_tokens":
        _positive("data.num_train", d.num_train, allow_none=False)
        if m.get("vocab_size") is not None and m.vocab_size < d.vocab_size:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than data.vocab_size={d.vocab_size}: raise it or set model.vocab_size=null")
    elif not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")


def check_vocab(cfg: DictConfig, data_vocab: Optional[int]) -> None:
    """A language model must embed every token id the data can contain."""
    size = cfg.model.get("vocab_size")
    if size is not None and data_vocab is not None and size < data_vocab:
        raise ConfigError(f"model.vocab_size={size} is smaller than the tokenizer's {data_vocab} tokens: raise it or set model.vocab_size=null")


# ----------------------------------------------------------------------------- files
def check_inputs(cfg: DictConfig) -> None:
    """The dataset or corpus the run will read is there; a missing CIFAR is downloaded now (if allowed),
    so that a failed download leaves no run directory behind."""
    d = cfg.data
    path = cfg.model.get("path")
    if path and not (Path(path).expanduser() / "config.json").is_file():  # before the tokenizer, which defaults to it
        where = "no such folder" if not Path(path).expanduser().exists() else "no config.json there"
        raise ConfigError(f"model.path={path}: {where}: point model.path at a Hugging Face model folder (config.json, *.safetensors, tokenizer files)")
    weights = cfg.model.get("weights")
    if weights and not Path(weights).expanduser().exists():
        raise ConfigError(f"model.weights={weights}: no such file or directory: give the path of a checkpoint of this model, or model.weights=null to start from random weights")
    if d.name in ("cifar10", "cifar100"):
        _check_cifar(d.name, str(d.root), bool(d.download), bool(d.verify_checksums))
    if d.name == "text":
        from rptrain.data.text import corpus_files

        files = corpus_files(d.path, d.glob)  # raises DataError naming data.path
        if not any(f.stat().st_size for f in files):
            raise DataError(f"data.path={d.path}: the text corpus is empty ({len(files)} file(s), 0 bytes): add text or point data.path elsewhere")
    if d.name == "chat":
        from rptrain.data.chat_formats import chat_files

        chat_files(d.path)
    if cfg.trainer.sample_prompts is not None:
        from .samples import load_prompts

        load_prompts(cfg.trainer.sample_prompts)  # a missing prompts file: one line now, not after the model is built
    if d.name in ("text", "chat"):
        from .tokenizer import tokenizer_source

        source = tokenizer_source(cfg)
        if source != "byte" and not Path(source).expanduser().exists():
            key = "data.tokenizer" if d.get("tokenizer") is not None else "model.path (the tokenizer's default)"
            raise DataError(f"{key}={source}: no such file or folder: give a tokenizer.json, a folder holding one, or data.tokenizer=byte")


@functools.lru_cache(maxsize=None)  # once per data set for all the jobs of a sweep
def _check_cifar(name: str, root_path: str, download: bool, verify_checksums: bool) -> None:
    from rptrain.data.cifar import cifar_files, load_cifar

    cifar_files(name, root_path, download, verify_checksums)  # there (downloaded if asked) and, if asked, the published files
    if not verify_checksums:  # a modified copy: its labels must still be class indices (the published files' are)
        for train in (True, False):
            load_cifar(name, root_path, train=train, verify_checksums=False)  # raises DataError naming the bad label


def check_writable(directory: Path, key: str) -> None:
    """`directory` exists as a writable folder or can be created: its nearest existing ancestor is one."""
    path = Path(directory).expanduser().absolute()
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{key}={directory} cannot be created: {ancestor} is a file; choose another directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={directory} is not writable ({ancestor} denies writing): choose another output_root or hydra.run.dir")

"""The data group -> train and eval loaders (rptrain.data), for images or token sequences.

Images take one of two paths (data.pipeline):
  tensor       the whole split as a uint8 tensor in memory; BatchAugment crops, flips and
               normalises each batch in one go on data.augment_device, in the compute dtype, so a
               GPU run is not input-bound;
  torchvision  the tutorial's per-sample PIL transforms behind a DataLoader (trainer.num_workers).
Both are exactly resumable: batch order and augmentation are functions of (seed, epoch, batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig

from rptrain.data import (
    BatchAugment,
    BatchLoader,
    DatasetLoader,
    ShardedLoader,
    cifar_dataset,
    cifar_eval_transforms,
    cifar_train_transforms,
    load_cifar,
    load_text_corpus,
    synthetic_images,
    synthetic_tokens,
)

from . import dist
from .errors import ConfigError
from .model import IMAGE, LM, data_kind
from .tokenizer import build_tokenizer
from .validate import local_batch


@dataclass
class TrainData:
    kind: str  # "image" or "lm"
    train: ShardedLoader
    eval: Optional[ShardedLoader]  # None when there is no held-out split
    vocab_size: Optional[int] = None  # language data only
    description: str = ""


def augment_device(data_cfg: DictConfig) -> torch.device:
    choice = data_cfg.augment_device.value
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("data.augment_device=cuda but no CUDA device is available: use data.augment_device=auto or cpu")
    return torch.device(choice)


def build_data(cfg: DictConfig, dtype: torch.dtype) -> TrainData:
    return _image_data(cfg, dtype) if data_kind(cfg.data) == IMAGE else _token_data(cfg)


def _shard(cfg: DictConfig) -> dict:
    """This rank's part of every global batch (trainer.batch_size), DistributedSampler-style: the
    union over ranks of their k-th batches is the k-th batch of a one-process run."""
    return dict(batch_size=local_batch(cfg), rank=dist.rank(), world_size=dist.world_size())


def _eval_batch(cfg: DictConfig) -> int:
    # Rank 0 evaluates the whole eval set alone, in batches no bigger than its training batches.
    return cfg.trainer.eval_batch_size or local_batch(cfg)


def _image_data(cfg: DictConfig, dtype: torch.dtype) -> TrainData:
    d, t = cfg.data, cfg.trainer
    if d.name != "synthetic" and d.pipeline.value == "torchvision":
        return _torchvision_data(cfg)
    if d.name == "synthetic":
        images, labels = synthetic_images(d.num_train + d.num_test, d.num_classes, d.image_size, 3, d.seed, d.noise)
        train, test = (images[: d.num_train], labels[: d.num_train]), (images[d.num_train :], labels[d.num_train :])
    else:
        tr = load_cifar(d.name, d.root, train=True, download=d.download, verify_checksums=d.verify_checksums)
        te = load_cifar(d.name, d.root, train=False, download=d.download, verify_checksums=d.verify_checksums)
        train, test = (tr.images, tr.labels), (te.images, te.labels)
    device = augment_device(d)
    if device.type == "cuda":  # 150 MB for CIFAR: batches are then gathered and augmented on the GPU
        train, test = tuple(x.to(device) for x in train), tuple(x.to(device) for x in test)
    augment = BatchAugment(d.mean, d.std, d.crop_padding, d.flip, out_dtype=dtype)
    normalise = BatchAugment(d.mean, d.std, 0, False, out_dtype=dtype).eval()
    return TrainData(
        IMAGE,
        BatchLoader(train, shuffle=True, drop_last=t.drop_last, seed=t.seed, transform=augment, prefetch=d.prefetch,
                    chunk_batches=d.chunk_batches, **_shard(cfg)),
        BatchLoader(test, _eval_batch(cfg), shuffle=False, drop_last=False, seed=t.seed, transform=normalise) if len(test[0]) else None,
        description=f"{d.name}: {len(train[0])} train / {len(test[0])} test images, augmented on {device.type}",
    )


def _torchvision_data(cfg: DictConfig) -> TrainData:
    d, t = cfg.data, cfg.trainer
    common = dict(name=d.name, root=d.root, download=d.download, verify_checksums=d.verify_checksums)
    trainset = cifar_dataset(train=True, transform=cifar_train_transforms(d.mean, d.std), **common)
    testset = cifar_dataset(train=False, transform=cifar_eval_transforms(d.mean, d.std), **common)
    loader = dict(seed=t.seed, num_workers=t.num_workers)
    return TrainData(
        IMAGE,
        DatasetLoader(trainset, shuffle=True, drop_last=t.drop_last, **_shard(cfg), **loader),
        DatasetLoader(testset, _eval_batch(cfg), shuffle=False, drop_last=False, **loader),
        description=f"{d.name}: {len(trainset)} train / {len(testset)} test images, per-sample torchvision transforms "
        f"({t.num_workers} workers)",
    )


def _token_data(cfg: DictConfig) -> TrainData:
    d, t = cfg.data, cfg.trainer
    if d.name == "text":
        tokenizer = build_tokenizer(cfg)
        corpus = load_text_corpus(d.path, tokenizer, d.seq_len, d.val_fraction)
        train, val, vocab = corpus.train, corpus.val, corpus.vocab_size
        about = f"text {d.path}: {corpus.num_tokens} tokens ({tokenizer!r})"
    else:
        inputs, targets = synthetic_tokens(d.num_train + d.num_val, d.seq_len, d.vocab_size, d.seed, d.branching)
        n = d.num_train
        train, val, vocab = (inputs[:n], targets[:n]), (inputs[n:], targets[n:]), d.vocab_size
        about = f"synthetic tokens: vocabulary {vocab}, branching {d.branching}"
    return TrainData(
        LM,
        BatchLoader(train, shuffle=True, drop_last=t.drop_last, seed=t.seed, **_shard(cfg)),
        BatchLoader(val, _eval_batch(cfg), shuffle=False, drop_last=False, seed=t.seed) if len(val[0]) else None,
        vocab_size=vocab,
        description=f"{about}; {len(train[0])} train / {len(val[0])} val sequences of {d.seq_len}",
    )

"""The data group -> train and eval loaders (rptrain.data), for images or token sequences.

Images take one of two paths (data.pipeline):
  tensor       the whole split as a uint8 tensor in memory; BatchAugment crops, flips and
               normalises each batch in one go on data.augment_device, in the compute dtype, so a
               GPU run is not input-bound;
  torchvision  the tutorial's per-sample PIL transforms behind a DataLoader (trainer.num_workers).
Both are exactly resumable: batch order and augmentation are functions of (seed, epoch, batch).

Token data: `text` reads windows from a memory-mapped token cache; `chat` renders conversations with
the tokenizer's chat template, masks the loss to the tokens data.train_on names and packs several
conversations a row (data.pack). Both hand the model (ids, targets, segment_ids).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from rptrain.data import (
    BatchAugment,
    BatchLoader,
    DataError,
    DatasetLoader,
    ShardedLoader,
    WindowLoader,
    cifar_dataset,
    cifar_eval_transforms,
    cifar_train_transforms,
    load_cifar,
    load_text_corpus,
    synthetic_images,
    synthetic_tokens,
)
from rptrain.data.chat import encode_all, pack, pad
from rptrain.data.chat_formats import read_conversations
from rptrain.data.chat_template import ChatTemplate

from . import dist
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
    tokenizer: Any = None  # language data from text or chat: what samples are encoded and decoded with
    template: Optional[ChatTemplate] = None  # chat data: sample prompts are rendered as a user turn


def augment_device(data_cfg: DictConfig) -> torch.device:
    choice = data_cfg.augment_device.value
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    if d.name == "chat":
        return _chat_data(cfg)
    if d.name == "text":
        tokenizer = build_tokenizer(cfg)
        corpus = load_text_corpus(d.path, tokenizer, d.seq_len, d.val_fraction, d.glob, d.cache_dir)
        cache = f"token cache {corpus.cache.path} ({'reused' if corpus.cache.reused else 'written'})"
        return TrainData(
            LM,
            WindowLoader(corpus.train, shuffle=True, drop_last=t.drop_last, seed=t.seed, **_shard(cfg)),
            WindowLoader(corpus.val, _eval_batch(cfg), shuffle=False, drop_last=False, seed=t.seed) if corpus.val else None,
            vocab_size=corpus.vocab_size,
            description=f"text {d.path}: {corpus.num_tokens} tokens in {len(corpus.files)} files ({tokenizer!r}), {cache}; "
            f"{len(corpus.train)} train / {len(corpus.val or [])} val sequences of {d.seq_len}",
            tokenizer=tokenizer,
        )
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


def _chat_tokenizer(cfg: DictConfig):
    """(tokenizer, chat template): data.tokenizer's (or the model's) with the template in its tokenizer_config.json."""
    tokenizer = build_tokenizer(cfg)
    return tokenizer, _template_for(cfg, tokenizer)


def _template_for(cfg: DictConfig, tokenizer: Any) -> ChatTemplate:
    path = getattr(tokenizer, "path", None)
    config = path.parent / "tokenizer_config.json" if path is not None else None
    return ChatTemplate.for_tokenizer(config if config and config.is_file() else None, cfg.data.chat_template)


def chat_template(cfg: DictConfig) -> ChatTemplate:
    """The template a chat run renders with (and exports)."""
    return _template_for(cfg, build_tokenizer(cfg))


CHAT_SEQ_LEN = 4096  # data.max_seq_len=null: rows this long at most, whatever context the model has


def model_context(cfg: DictConfig) -> Optional[int]:
    """The longest sequence the model takes: model.max_seq_len, or for model=hf (null) its config.json's."""
    if cfg.model.get("max_seq_len") is not None or not cfg.model.get("path"):
        return cfg.model.get("max_seq_len")
    from rptrain.models.hf_config import decoder_config, read_config_json

    try:
        return decoder_config(read_config_json(cfg.model.path), "config.json").max_seq_len
    except ValueError:  # an unsupported config.json: building the model says why, naming the field
        return None


def chat_seq_len(cfg: DictConfig) -> int:
    """data.max_seq_len, or (null) the model's context, at most CHAT_SEQ_LEN."""
    return cfg.data.max_seq_len or min(model_context(cfg) or CHAT_SEQ_LEN, CHAT_SEQ_LEN)


def _chat_data(cfg: DictConfig) -> TrainData:
    d, t = cfg.data, cfg.trainer
    seq_len = chat_seq_len(cfg)
    tokenizer, template = _chat_tokenizer(cfg)
    conversations = list(read_conversations(d.path, d.format.value))
    n_val = int(len(conversations) * d.val_fraction)
    split = len(conversations) - n_val
    args = (tokenizer, template, d.train_on.value, seq_len, d.too_long.value)
    train, val = encode_all(conversations[:split], *args), encode_all(conversations[split:], *args)
    if not train.pairs:
        raise DataError(f"data.path={d.path}: no conversation left to train on ({train.stats.line(seq_len, d.too_long.value)}): "
                        f"check data.format, data.train_on and data.max_seq_len")
    rows = (lambda pairs: pack(pairs, seq_len)) if d.pack else pad
    train_rows = rows(train.pairs)
    val_rows = rows(val.pairs) if val.pairs else None
    filled = train.stats.tokens / train_rows[0].numel()
    return TrainData(
        LM,
        BatchLoader(train_rows, shuffle=True, drop_last=t.drop_last, seed=t.seed, **_shard(cfg)),
        BatchLoader(val_rows, _eval_batch(cfg), shuffle=False, drop_last=False, seed=t.seed) if val_rows else None,
        vocab_size=tokenizer.vocab_size,
        description=f"chat {d.path} ({template.name}, train_on={d.train_on.value}): {train.stats.line(seq_len, d.too_long.value)}; "
        f"{len(train_rows[0])} train / {len(val_rows[0]) if val_rows else 0} val sequences of {train_rows[0].shape[1]} "
        f"({'packed' if d.pack else 'padded'}, {filled:.0%} tokens)",
        tokenizer=tokenizer,
        template=template,
    )

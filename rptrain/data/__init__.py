"""Data for rptrain: datasets as in-memory tensors and exact, resumable, shardable batches.

  cifar.py          CIFAR-10/100 through torchvision's dataset classes -> uint8 NCHW tensors
  augment.py        BatchAugment: crop/flip/normalise a whole batch on its device
  loader.py         BatchLoader: seeded order, DistributedSampler-style shards, resume
  dataset_loader.py DatasetLoader: the per-sample torchvision transforms path (slower)
  synthetic.py      learnable random images and token sequences
  text.py           the byte tokenizer and packed text corpora
  hf_tokenizer.py   Hugging Face tokenizer folders (tokenizer.json + tokenizer_config.json)
  errors.py         DataError, raised for every bad input

torchvision and tokenizers are only imported when a function needs them.
"""
from .augment import BatchAugment, crop_flip
from .cifar import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    CIFAR_STATS,
    CifarSplit,
    cifar_dataset,
    load_cifar,
)
from .dataset_loader import DatasetLoader, cifar_eval_transforms, cifar_train_transforms
from .errors import DataError
from .loader import BatchLoader, ShardedLoader, mix_seed, shard_indices
from .synthetic import synthetic_images, synthetic_tokens
from .hf_tokenizer import HFTokenizer, load_tokenizer
from .text import ByteTokenizer, TextCorpus, Tokenizer, get_tokenizer, load_text_corpus

__all__ = [
    "BatchAugment",
    "crop_flip",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CIFAR_STATS",
    "CifarSplit",
    "cifar_dataset",
    "load_cifar",
    "DatasetLoader",
    "cifar_train_transforms",
    "cifar_eval_transforms",
    "DataError",
    "BatchLoader",
    "ShardedLoader",
    "mix_seed",
    "shard_indices",
    "synthetic_images",
    "synthetic_tokens",
    "ByteTokenizer",
    "HFTokenizer",
    "TextCorpus",
    "Tokenizer",
    "get_tokenizer",
    "load_text_corpus",
    "load_tokenizer",
]

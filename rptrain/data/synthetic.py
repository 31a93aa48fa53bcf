"""Seeded synthetic datasets for smoke tests and benchmarks: no files, no downloads.

Both are learnable on purpose, so a falling loss shows the training loop works:
images carry a per-class pattern, token sequences follow a sparse random Markov chain.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import DataError


def synthetic_images(
    n: int,
    num_classes: int = 10,
    image_size: int = 32,
    channels: int = 3,
    seed: int = 0,
    noise: float = 40.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 (n, channels, size, size), labels int64 (n,)), like load_cifar's output.

    Each class has a smooth random template (a 4x4 grid of colours, upsampled);
    an image is its class's template plus Gaussian pixel noise of std `noise`.
    """
    if n < 1 or num_classes < 1 or image_size < 1 or channels < 1:
        raise DataError(
            f"synthetic images need n, num_classes, image_size, channels >= 1, got {n}, {num_classes}, {image_size}, {channels}"
        )
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    coarse = torch.rand(num_classes, channels, 4, 4, generator=g) * 255
    templates = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = templates[labels] + noise * torch.randn(n, channels, image_size, image_size, generator=g)
    return images.round_().clamp_(0, 255).to(torch.uint8), labels


def synthetic_tokens(
    n: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    branching: int | None = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both int64 (n, seq_len) with targets = inputs shifted by one.

    Each token may be followed by one of `branching` fixed random successors,
    so the best achievable loss is log(branching) instead of log(vocab_size).
    branching=None gives uniformly random (unlearnable) tokens. Like
    load_text_corpus, the two tensors are views of one (n, seq_len + 1) tensor.
    """
    if n < 1 or seq_len < 1 or vocab_size < 2:
        raise DataError(f"synthetic tokens need n >= 1, seq_len >= 1, vocab_size >= 2, got {n}, {seq_len}, {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    if branching is None:
        seqs = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)
    else:
        if branching < 1:
            raise DataError(f"synthetic tokens branching={branching} must be >= 1 (or None for uniform tokens)")
        successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        choices = torch.randint(0, branching, (n, seq_len), generator=g)
        seqs = torch.empty(n, seq_len + 1, dtype=torch.int64)
        seqs[:, 0] = torch.randint(0, vocab_size, (n,), generator=g)
        for t in range(seq_len):  # one vectorised step per position, across all sequences
            seqs[:, t + 1] = successors[seqs[:, t], choices[:, t]]
    return seqs[:, :-1], seqs[:, 1:]

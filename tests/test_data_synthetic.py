"""Synthetic image and token data: shapes, determinism, and that they carry learnable signal."""
import math

import pytest
import torch

from rptrain.data import DataError, synthetic_images, synthetic_tokens


def test_synthetic_images_shape_determinism_and_signal():
    images, labels = synthetic_images(600, num_classes=20, seed=1)
    assert images.shape == (600, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and int(labels.max()) < 20
    again, _ = synthetic_images(600, num_classes=20, seed=1)
    assert torch.equal(images, again)
    assert not torch.equal(images, synthetic_images(600, num_classes=20, seed=2)[0])
    # Nearest class centroid, fit on half and scored on the other half, is far above chance.
    x = images.float().flatten(1)
    centroids = torch.stack([x[:300][labels[:300] == c].mean(0) for c in range(20)])
    acc = (torch.cdist(x[300:], centroids).argmin(1) == labels[300:]).float().mean()
    assert acc > 0.8
    assert synthetic_images(4, image_size=8, channels=1)[0].shape == (4, 1, 8, 8)


def test_synthetic_tokens():
    x, y = synthetic_tokens(64, seq_len=16, vocab_size=50, seed=0)
    assert x.shape == y.shape == (64, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 50
    assert torch.equal(x, synthetic_tokens(64, seq_len=16, vocab_size=50, seed=0)[0])
    # Each token is followed by at most `branching` distinct tokens, so loss can go well below log(vocab).
    successors = {}
    for a, b in zip(x.flatten().tolist(), y.flatten().tolist()):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4 < math.log(50) * 10
    u, _ = synthetic_tokens(8, seq_len=32, vocab_size=1000, branching=None)
    assert len(set(u.flatten().tolist())) > 150
    with pytest.raises(DataError):
        synthetic_tokens(1, seq_len=4, vocab_size=1)
    with pytest.raises(DataError):
        synthetic_images(0)

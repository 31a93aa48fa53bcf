"""BatchAugment against torchvision's per-image RandomCrop(32, padding=4) + RandomHorizontalFlip pipeline."""
import time

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image

from rptrain.data import CIFAR100_MEAN, CIFAR100_STD, BatchAugment, DataError, crop_flip


def _images(n, seed=0):
    return torch.randint(0, 256, (n, 3, 32, 32), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _torchvision_fixed(img_chw, top, left, flip, normalize=True):
    """torchvision's tutorial pipeline on a PIL image, with the crop/flip draws fixed to (top, left, flip)."""
    pil = Image.fromarray(img_chw.permute(1, 2, 0).numpy())
    pil = TF.crop(TF.pad(pil, 4), top, left, 32, 32)  # what RandomCrop(32, padding=4) does for draw (top, left)
    if flip:
        pil = TF.hflip(pil)
    if not normalize:
        return torch.from_numpy(np.array(pil)).permute(2, 0, 1)
    return TF.normalize(TF.to_tensor(pil), CIFAR100_MEAN, CIFAR100_STD)


def test_crop_flip_matches_manual_slices_and_torchvision():
    images = _images(6)
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    cases = [(0, 0, False), (8, 8, True), (4, 4, False), (3, 7, True), (8, 0, False), (0, 5, True)]
    top, left, flip = (torch.tensor(v) for v in zip(*cases))
    out = crop_flip(images, top, left, flip, padding=4)
    for i, (t, l, f) in enumerate(cases):
        manual = padded[i, :, t : t + 32, l : l + 32]
        if f:
            manual = manual.flip(-1)
        assert torch.equal(out[i], manual)
        assert torch.equal(out[i], _torchvision_fixed(images[i], t, l, f, normalize=False))


def test_full_pipeline_matches_torchvision_for_the_drawn_offsets():
    images = _images(16, seed=1)
    aug = BatchAugment(CIFAR100_MEAN, CIFAR100_STD)
    out = aug(images, torch.Generator().manual_seed(5))
    # BatchAugment's documented draw order: tops, lefts, flips.
    g = torch.Generator().manual_seed(5)
    top, left = torch.randint(0, 9, (16,), generator=g), torch.randint(0, 9, (16,), generator=g)
    flip = torch.randint(0, 2, (16,), generator=g).bool()
    for i in range(16):
        ref = _torchvision_fixed(images[i], int(top[i]), int(left[i]), bool(flip[i]))
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=0)


def test_offsets_and_flips_are_uniform():
    # Channel 0 holds row+1, channel 1 col+1 (padding reads 0), so each output reveals its crop and flip.
    n = 4000
    r = torch.arange(1, 33, dtype=torch.uint8)
    base = torch.stack([r.view(32, 1).expand(32, 32), r.view(1, 32).expand(32, 32), torch.zeros(32, 32, dtype=torch.uint8)])
    # mean 0 and std 1/255 make normalisation the identity, so outputs are the cropped pixel values.
    out = BatchAugment((0, 0, 0), (1 / 255,) * 3)(base.expand(n, 3, 32, 32), torch.Generator().manual_seed(0))
    out = out.round().long()
    flipped = out[:, 1, 16, 15] > out[:, 1, 16, 16]
    top = out[:, 0, 16, 16] - 13
    left = torch.where(flipped, out[:, 1, 16, 16] - 12, out[:, 1, 16, 16] - 13)
    assert 0.45 < flipped.float().mean() < 0.55
    counts = torch.bincount(top * 9 + left, minlength=81)
    assert len(counts) == 81 and counts.min() > 20  # all 81 offsets of RandomCrop(32, padding=4), ~49 each
    chi2 = ((counts.float() - n / 81) ** 2 / (n / 81)).sum()
    assert chi2 < 140  # 80 degrees of freedom; p < 1e-4 above this


def test_deterministic_given_generator_and_independent_of_global_rng():
    images = _images(32)
    aug = BatchAugment(CIFAR100_MEAN, CIFAR100_STD)
    torch.manual_seed(1)
    a = aug(images, torch.Generator().manual_seed(3))
    torch.manual_seed(2)
    b = aug(images, torch.Generator().manual_seed(3))
    c = aug(images, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_dtype_shape_and_eval_mode():
    images = _images(8)
    aug = BatchAugment(CIFAR100_MEAN, CIFAR100_STD, out_dtype=torch.float16)
    out = aug(images, torch.Generator().manual_seed(0))
    assert out.shape == (8, 3, 32, 32) and out.dtype == torch.float16
    ref = (images.float() / 255 - torch.tensor(CIFAR100_MEAN).view(1, 3, 1, 1)) / torch.tensor(CIFAR100_STD).view(1, 3, 1, 1)
    assert torch.allclose(aug.eval()(images).float(), ref, atol=2e-3)  # fp16 rounding
    assert torch.allclose(BatchAugment(CIFAR100_MEAN, CIFAR100_STD).eval()(images), ref, atol=1e-5)
    no_aug = BatchAugment(CIFAR100_MEAN, CIFAR100_STD, crop_padding=0, flip=False)
    assert torch.allclose(no_aug(images, torch.Generator()), ref, atol=1e-5)


def test_bad_input():
    aug = BatchAugment(CIFAR100_MEAN, CIFAR100_STD)
    with pytest.raises(DataError, match="uint8"):
        aug(torch.zeros(2, 3, 32, 32))
    with pytest.raises(DataError, match="std"):
        BatchAugment((0.5,), (0.0,))


def test_cpu_speed_sanity():
    images = _images(512)
    aug = BatchAugment(CIFAR100_MEAN, CIFAR100_STD)
    aug(images, torch.Generator().manual_seed(0))  # warm-up
    t = time.perf_counter()
    for i in range(5):
        aug(images, torch.Generator().manual_seed(i))
    per_batch = (time.perf_counter() - t) / 5
    assert per_batch < 0.25, f"{per_batch * 1000:.0f} ms for a 512-image batch"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    images = _images(64)
    aug = BatchAugment(CIFAR100_MEAN, CIFAR100_STD)
    cpu = aug(images, torch.Generator().manual_seed(9))
    gpu = aug(images.cuda(), torch.Generator().manual_seed(9))
    assert gpu.is_cuda
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=0)

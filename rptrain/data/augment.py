"""Random crop + horizontal flip + normalisation for a whole uint8 NCHW batch at once.

This is the batched equivalent of torchvision's
RandomCrop(size, padding=p) -> RandomHorizontalFlip() -> ToTensor() -> Normalize(mean, std):
each image gets its own crop offset and flip, but all of them are applied
with one gather on the device the batch already lives on, so augmentation
costs a few kernels per batch on a GPU instead of a Python loop per image.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .errors import DataError
from .transfer import to_device


def crop_flip(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, padding: int) -> torch.Tensor:
    """Zero-pad each image by `padding`, cut an HxW window at (top, left) and mirror it where `flip`.

    `top`/`left` are per-image offsets in [0, 2*padding] into the padded image,
    exactly like the (i, j) torchvision's RandomCrop draws. Works on any dtype.
    """
    draws = torch.stack([top.long(), left.long(), flip.long()])
    return _crop_flip(images, to_device(draws, images.device), padding)


def _crop_flip(images: torch.Tensor, draws: torch.Tensor, padding: int) -> torch.Tensor:
    """crop_flip with the offsets and flips as one (3, n) tensor already on the images' device:
    one gather over each padded image, a handful of kernels whatever the batch size."""
    n, c, h, w = images.shape
    dev = images.device
    padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
    top, left, flip = draws
    rows = top.view(n, 1) + torch.arange(h, device=dev)  # (n, h)
    cols = left.view(n, 1) + torch.arange(w, device=dev)  # (n, w)
    cols = torch.where(flip.view(n, 1) != 0, cols.flip(1), cols)  # mirroring = reading columns backwards
    where = (rows.view(n, h, 1) * padded.shape[3] + cols.view(n, 1, w)).view(n, 1, h * w)  # offsets within a padded image
    out = padded.reshape(n, c, -1).gather(2, where.expand(n, c, h * w))
    return out.view(n, c, h, w)


class BatchAugment:
    """Callable `aug(images_uint8_nchw, generator) -> normalised out_dtype batch`.

    Random numbers come from `generator` (a CPU torch.Generator), drawn in a
    fixed order: crop tops, crop lefts, flips. The same generator state thus
    gives the same augmentation on CPU and on CUDA, which is what makes
    resumed runs reproduce their batches. Without a generator the global RNG
    is used. After .eval() the call only normalises.
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        crop_padding: int = 4,
        flip: bool = True,
        out_dtype: torch.dtype = torch.float32,
    ) -> None:
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise DataError(f"augment mean {tuple(mean)} and std {tuple(std)} must have one entry per channel and std > 0")
        if crop_padding < 0:
            raise DataError(f"augment crop_padding={crop_padding} must be >= 0")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.crop_padding = int(crop_padding)
        self.flip = bool(flip)
        self.out_dtype = out_dtype
        self.training = True
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def train(self, mode: bool = True) -> "BatchAugment":
        self.training = mode
        return self

    def eval(self) -> "BatchAugment":
        return self.train(False)

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        draws = self.draw(images.shape[0], generator)
        return self.apply(images, None if draws is None else to_device(draws, images.device))

    def draw(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor | None:
        """The random part for `n` images as a (3, n) int64 tensor: crop tops, crop lefts, flips,
        drawn in that order (None after .eval(), or with nothing random to draw). Loaders draw a
        whole epoch's worth at once and send it to the device in one copy."""
        if not (self.training and (self.crop_padding or self.flip)):
            return None
        p = self.crop_padding
        top = torch.randint(0, 2 * p + 1, (n,), generator=generator)
        left = torch.randint(0, 2 * p + 1, (n,), generator=generator)
        flip = torch.randint(0, 2, (n,), generator=generator) if self.flip else torch.zeros(n, dtype=torch.long)
        return torch.stack([top, left, flip])

    def apply(self, images: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
        """Crop and flip by `draws` (from draw(), on the images' device), then normalise."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != len(self.mean):
            raise DataError(
                f"BatchAugment expects a uint8 (N, {len(self.mean)}, H, W) batch, got {images.dtype} {tuple(images.shape)}"
            )
        if draws is not None:
            images = _crop_flip(images, draws, self.crop_padding)  # still uint8: moves 1 byte per pixel
        return self.normalize(images)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """(x / 255 - mean) / std, folded into one multiply-add, computed in float32 then cast."""
        consts = self._consts.get(images.device)
        if consts is None:  # made once per device: creating them each batch costs two synchronous copies
            scale = torch.tensor([1.0 / (255.0 * s) for s in self.std]).view(1, -1, 1, 1)
            shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)]).view(1, -1, 1, 1)
            consts = self._consts[images.device] = (scale.to(images.device), shift.to(images.device))
        scale, shift = consts
        return torch.addcmul(shift, images.float(), scale).to(self.out_dtype)

    def __repr__(self) -> str:
        mode = "train" if self.training else "eval"
        return f"BatchAugment(crop_padding={self.crop_padding}, flip={self.flip}, out_dtype={self.out_dtype}, mode={mode})"

"""The slower, classic path: a torchvision-style dataset with per-sample transforms behind torch's DataLoader.

Use it to reproduce a tutorial exactly (PIL images, RandomCrop/RandomHorizontalFlip
per sample, CPU worker processes). For CIFAR-sized data, BatchLoader + BatchAugment
does the same work on whole batches and is much faster.

It keeps BatchLoader's order, sharding and resume semantics. Per-sample random
transforms are made reproducible by re-seeding torch's RNG from
(seed, epoch, sample index) around each sample, so the augmentation of a sample
does not depend on which worker loaded it or on what was loaded before. Resuming
at batch k therefore just starts the sampler k batches in; nothing is replayed.
Only transforms that draw from torch's RNG are covered (torchvision's are);
ones using `random` or numpy are not.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .errors import DataError
from .loader import Batch, ShardedLoader, mix_seed


class _SeededSamples(Dataset):
    """dataset[(epoch, i)] -> dataset[i] computed under a torch RNG seeded from (seed, epoch, i)."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, i = key
        with torch.random.fork_rng(devices=[]):  # leaves the caller's CPU RNG untouched
            torch.manual_seed(mix_seed(self.seed, epoch, i))
            return self.dataset[i]


class DatasetLoader(ShardedLoader):
    """Batches from a map-style dataset through torch.utils.data.DataLoader.

    Same iteration API as BatchLoader: `loader.epoch(epoch, start_batch)`,
    `len(loader)`, `state_dict()/load_state_dict()`. Batches are whatever the
    default collate makes of the samples (for (image, label) samples: a tuple
    (images, labels)), moved to `device` if given. A fresh DataLoader (and
    fresh workers) is made each epoch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        if num_workers < 0:
            raise DataError(f"num_workers={num_workers} must be >= 0")
        super().__init__(len(dataset), batch_size, shuffle, drop_last, seed, rank, world_size)
        self.dataset = dataset
        self.num_workers = num_workers
        self.device = torch.device(device) if device is not None else None

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        self._check_start(start_batch)
        keys = [(epoch, int(i)) for i in self.indices(epoch)[start_batch * self.batch_size :]]
        pin = self.device is not None and self.device.type == "cuda"
        loader = DataLoader(
            _SeededSamples(self.dataset, self.seed),
            batch_size=self.batch_size,
            sampler=keys,
            num_workers=self.num_workers,
            pin_memory=pin,
            # Only seeds the workers' base RNG state; every sample is re-seeded anyway.
            generator=torch.Generator().manual_seed(mix_seed(self.seed, epoch)),
        )
        for b, batch in enumerate(loader, start=start_batch):
            if self.device is not None:
                batch = _to_device(batch, self.device)
            self.current_epoch, self.next_batch = epoch, b + 1
            yield tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(x, device) for x in batch)
    return batch


def cifar_train_transforms(mean: Sequence[float], std: Sequence[float]) -> Any:
    """The per-sample CPU pipeline of the classic CIFAR tutorials."""
    from torchvision import transforms as T

    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])


def cifar_eval_transforms(mean: Sequence[float], std: Sequence[float]) -> Any:
    from torchvision import transforms as T

    return T.Compose([T.ToTensor(), T.Normalize(mean, std)])

"""CIFAR-10/100 as in-memory tensors, read through torchvision's own dataset classes.

The whole dataset is small (150 MB as uint8), so it is loaded once into a
uint8 NCHW tensor and batched/augmented on whatever device trains
(see loader.py and augment.py) instead of going through per-sample PIL
transforms.
"""
from __future__ import annotations

import functools
import numbers
import pickle
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from .errors import DataError

# Per-channel mean/std of the training images, on the [0, 1] scale.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR100_STD = (0.2675, 0.2565, 0.2761)
CIFAR_STATS = {"cifar10": (CIFAR10_MEAN, CIFAR10_STD), "cifar100": (CIFAR100_MEAN, CIFAR100_STD)}

_TITLES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}


class CifarSplit(NamedTuple):
    images: torch.Tensor  # (N, 3, 32, 32) uint8, contiguous
    labels: torch.Tensor  # (N,) int64
    classes: list[str]


@functools.cache
def _dataset_class(name: str, verify_checksums: bool) -> type:
    # torchvision is imported here, not at module top, so `import rptrain.data` stays cheap.
    from torchvision.datasets import CIFAR10, CIFAR100

    base = CIFAR10 if name == "cifar10" else CIFAR100
    if verify_checksums:
        return base

    class Unchecked(base):
        """Trusts any copy whose files exist.

        torchvision compares each file's md5 with the published archive, which
        rejects legitimate copies that were re-pickled or trimmed, and tests
        that run in a subprocess cannot patch the expected md5s. This class
        only checks that the files are there; a malformed file then fails
        while being read, and load_cifar reports it.
        """

        meta = {**base.meta, "md5": None}  # check_integrity(path, None) only tests that the file exists

        def _check_integrity(self) -> bool:
            return _files_present(Path(self.root) / self.base_folder, type(self))

    Unchecked.__name__ = Unchecked.__qualname__ = f"Unchecked{base.__name__}"
    return Unchecked


def _files_present(folder: Path, cls: type) -> bool:
    names = [n for n, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    return all((folder / n).is_file() for n in names)


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def cifar_dataset(
    name: str,
    root: str | Path,
    train: bool = True,
    download: bool = False,
    verify_checksums: bool = True,
    transform: Callable | None = None,
) -> Any:
    """torchvision's CIFAR10/CIFAR100 dataset object, with bad input turned into DataError.

    `root` is the folder that contains cifar-10-batches-py/ or cifar-100-python/
    (passing that inner folder itself also works). With verify_checksums=False
    files are only checked for existence; see _dataset_class for why.
    `transform` is the per-sample transform (see dataset_loader.py).
    """
    key = str(name).lower().replace("-", "")
    if key not in _TITLES:
        raise DataError(f"unknown dataset {name!r}: data.name must be 'cifar10' or 'cifar100'")
    title = _TITLES[key]
    cls = _dataset_class(key, verify_checksums)
    root = Path(root).expanduser()
    if root.name == cls.base_folder:
        root = root.parent
    if root.exists() and not root.is_dir():
        raise DataError(f"data.root={root} is a file: set data.root to a folder containing {cls.base_folder}/")
    hint = f"set data.root to a folder containing {cls.base_folder}/"
    present = _files_present(root / cls.base_folder, cls)
    if not present and not download:
        raise DataError(f"{title} not found under {root}: {hint} or data.download=true")

    try:
        ds = cls(str(root), train=train, download=download, transform=transform)
    except (OSError, RuntimeError) as err:
        if download:  # torchvision tried to download and failed (no network, HTTP error, bad archive)
            raise DataError(f"{title} download to {root} failed ({_one_line(err)}): check the network, or {hint}") from err
        raise DataError(
            f"{title} files under {root / cls.base_folder} failed the integrity check ({_one_line(err)}): "
            f"re-download them with data.download=true, or set data.verify_checksums=false for a modified copy"
        ) from err
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as err:
        raise DataError(f"could not read {title} from {root / cls.base_folder} ({_one_line(err)}): {hint}") from err
    return ds


def load_cifar(
    name: str,
    root: str | Path,
    train: bool = True,
    download: bool = False,
    verify_checksums: bool = True,
) -> CifarSplit:
    """Load one split of CIFAR-10 or CIFAR-100 as (images uint8 NCHW, labels int64, class names).

    Arguments and errors as for cifar_dataset.
    """
    ds = cifar_dataset(name, root, train, download, verify_checksums)
    # ds.data is an HWC view of the channel-major arrays in the files, so this permute is copy-free.
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
    bad = next((i for i, y in enumerate(ds.targets) if not (isinstance(y, numbers.Integral) and not isinstance(y, bool) and 0 <= y < len(ds.classes))), None)
    if bad is not None:
        raise DataError(
            f"{ds.root}/{ds.base_folder}: {'training' if train else 'test'} label {bad} is {ds.targets[bad]!r}, not a class index "
            f"in 0..{len(ds.classes) - 1}: restore the data set (data.download=true with a fresh data.root) or fix its labels"
        )
    labels = torch.as_tensor(ds.targets, dtype=torch.int64)
    if images.shape[1:] != (3, 32, 32) or len(labels) != len(images):
        raise DataError(f"{ds.root} has images {tuple(images.shape)} and {len(labels)} labels: expected (N, 3, 32, 32) and N")
    return CifarSplit(images, labels, list(ds.classes))

"""CIFAR-10/100 as in-memory tensors.

The whole dataset is small (150 MB as uint8), so it is loaded once into a
uint8 NCHW tensor and batched/augmented on whatever device trains
(see loader.py and augment.py) instead of going through per-sample PIL
transforms. ``load_cifar`` reads the dataset authors' pickles itself, through an
unpickler that builds arrays, lists and strings and nothing else: a file read
with pickle.load (torchvision's way) can run any code it names. torchvision's
dataset classes (``cifar_dataset``) download the archive and serve the
per-sample pipeline; the tensor pipeline does not import torchvision (0.1 s of
the CLI's start on the dev machine, beyond torch._dynamo, which torch.optim
imports anyway). tests/test_data_cifar.py checks both read the same images and labels.
"""
from __future__ import annotations

import functools
import hashlib
import numbers
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, NamedTuple

import numpy as np

import torch

from .errors import DataError

# Per-channel mean/std of the training images, on the [0, 1] scale.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR100_STD = (0.2675, 0.2565, 0.2761)
CIFAR_STATS = {"cifar10": (CIFAR10_MEAN, CIFAR10_STD), "cifar100": (CIFAR100_MEAN, CIFAR100_STD)}

_TITLES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}


@dataclass(frozen=True)
class CifarFormat:
    """One data set's files as its authors publish them (python version): folder, (file, md5) of each split
    and of the meta file, and the keys of the labels and of the class names."""

    folder: str
    train: tuple[tuple[str, str], ...]
    test: tuple[tuple[str, str], ...]
    meta: tuple[str, str]
    labels_key: str
    names_key: str

    def files(self, train: bool) -> tuple[tuple[str, str], ...]:
        return self.train if train else self.test

    def every_file(self) -> tuple[tuple[str, str], ...]:
        return (*self.train, *self.test, self.meta)


FORMATS = {
    "cifar10": CifarFormat(
        "cifar-10-batches-py",
        (("data_batch_1", "c99cafc152244af753f735de768cd75f"), ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
         ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"), ("data_batch_4", "634d18415352ddfa80567beed471001a"),
         ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb")),
        (("test_batch", "40351d587109b95175f43aff81a1287e"),), ("batches.meta", "5ff9c542aee3614f3951f8cda6e48888"),
        "labels", "label_names"),
    "cifar100": CifarFormat(
        "cifar-100-python", (("train", "16019d7e3df5f24257cddd939b257f8d"),), (("test", "f0ef6b0ae62326f3e7ffdfab6717acfc"),),
        ("meta", "7973b15100ade9c7d40fb424638fde48"), "fine_labels", "fine_label_names"),
}

try:  # numpy 2 (numpy.core is its deprecated alias)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct

# What a CIFAR pickle may name: numpy's array reconstruction (its module as numpy 1 and numpy 2 write it).
_ARRAY_GLOBALS = {("numpy.core.multiarray", "_reconstruct"): _reconstruct, ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
                  ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}


class _DataUnpickler(pickle.Unpickler):
    """Builds dicts, lists, strings and numpy arrays; any other global is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ARRAY_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}; a CIFAR file holds only arrays, lists and strings")
        return found


def _read_pickle(f: BinaryIO) -> dict:
    entry = _DataUnpickler(f, encoding="latin1").load()  # the files are Python 2 pickles: their str are latin-1
    if not isinstance(entry, dict):
        raise TypeError(f"the file holds a {type(entry).__name__}, not a dict")
    return entry


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
            return _files_present(Path(self.root) / self.base_folder, FORMATS[name])

    Unchecked.__name__ = Unchecked.__qualname__ = f"Unchecked{base.__name__}"
    return Unchecked


def _files_present(folder: Path, fmt: CifarFormat) -> bool:
    return all((folder / f).is_file() for f, _ in fmt.every_file())


def _locate(name: str, root: str | Path) -> tuple[str, str, CifarFormat, Path]:
    """(key, title, format, root) of a data set name and data.root (its inner folder is forgiven); DataError
    for an unknown name or a root that is a file."""
    key = str(name).lower().replace("-", "")
    if key not in _TITLES:
        raise DataError(f"unknown dataset {name!r}: data.name must be 'cifar10' or 'cifar100'")
    fmt = FORMATS[key]
    root = Path(root).expanduser()
    if root.name == fmt.folder:
        root = root.parent
    if root.exists() and not root.is_dir():
        raise DataError(f"data.root={root} is a file: set data.root to a folder containing {fmt.folder}/")
    return key, _TITLES[key], fmt, root


def _not_found(title: str, root: Path, fmt: CifarFormat) -> DataError:
    return DataError(f"{title} not found under {root}: set data.root to a folder containing {fmt.folder}/, "
                     "or data.download=true, or use data=synthetic")


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
    key, title, fmt, root = _locate(name, root)
    cls = _dataset_class(key, verify_checksums)
    hint = f"set data.root to a folder containing {fmt.folder}/"
    if not download and not _files_present(root / fmt.folder, fmt):
        raise _not_found(title, root, fmt)

    try:
        ds = cls(str(root), train=train, download=download, transform=transform)
    except (OSError, RuntimeError) as err:
        if download:  # torchvision tried to download and failed (no network, HTTP error, bad archive)
            raise DataError(f"{title} download to {root} failed ({_one_line(err)}): check the network, or {hint}") from err
        raise DataError(
            f"{title} files under {root / fmt.folder} failed the integrity check ({_one_line(err)}): "
            f"re-download them with data.download=true, or set data.verify_checksums=false for a modified copy"
        ) from err
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as err:
        raise DataError(f"could not read {title} from {root / fmt.folder} ({_one_line(err)}): {hint}") from err
    return ds


# A file's md5 by (path, size, modification time): the preflight check and the data's loading verify the same files.
_MD5S: dict[tuple[str, int, int], str] = {}


def _md5(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _MD5S:
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        _MD5S[key] = digest.hexdigest()
    return _MD5S[key]


def cifar_files(name: str, root: str | Path, download: bool = False, verify_checksums: bool = True,
                splits: tuple[bool, ...] = (True, False)) -> tuple[str, CifarFormat, Path]:
    """(title, format, folder) of a data set on disk, downloaded first where it is missing and ``download``, and
    the files of ``splits`` (True: training) and the meta file checked against the published md5s where
    ``verify_checksums``. Bad input, a missing copy or a failed check is a DataError."""
    key, title, fmt, root = _locate(name, root)
    folder = root / fmt.folder
    if not _files_present(folder, fmt):
        if not download:
            raise _not_found(title, root, fmt)
        cifar_dataset(key, root, download=True, verify_checksums=verify_checksums)  # torchvision's download; DataError offline
    if verify_checksums:
        for f, md5 in (*[file for train in splits for file in fmt.files(train)], fmt.meta):
            if _md5(folder / f) != md5:
                raise DataError(f"{title} files under {folder} failed the integrity check: {f} does not match the published "
                                f"checksum: re-download them with data.download=true, or set data.verify_checksums=false for a modified copy")
    return title, fmt, folder


def load_cifar(
    name: str,
    root: str | Path,
    train: bool = True,
    download: bool = False,
    verify_checksums: bool = True,
) -> CifarSplit:
    """Load one split of CIFAR-10 or CIFAR-100 as (images uint8 NCHW, labels int64, class names).

    `root` is the folder that contains cifar-10-batches-py/ or cifar-100-python/ (or that folder itself).
    The files are read as data (_DataUnpickler); bad input is a DataError naming what to do.
    """
    title, fmt, folder = cifar_files(name, root, download, verify_checksums, splits=(train,))
    hint = f"set data.root to a folder containing {fmt.folder}/"
    try:
        entries = []
        for f, _ in fmt.files(train):
            with open(folder / f, "rb") as fh:
                entries.append(_read_pickle(fh))
        with open(folder / fmt.meta[0], "rb") as fh:
            classes = [str(c) for c in _read_pickle(fh)[fmt.names_key]]
        # The rows are channel-major (3 x 32 x 32 per image): NCHW as they lie.
        rows = np.concatenate([np.asarray(e["data"], dtype=np.uint8).reshape(-1, 3072) for e in entries])
        targets = [y for e in entries for y in e[fmt.labels_key]]
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError) as err:
        raise DataError(f"could not read {title} from {folder} ({_one_line(err)}): {hint}") from err
    images = torch.from_numpy(rows).view(-1, 3, 32, 32)
    bad = next((i for i, y in enumerate(targets) if not (isinstance(y, numbers.Integral) and not isinstance(y, bool) and 0 <= y < len(classes))), None)
    if bad is not None:
        raise DataError(
            f"{folder}: {'training' if train else 'test'} label {bad} is {targets[bad]!r}, not a class index "
            f"in 0..{len(classes) - 1}: restore the data set (data.download=true with a fresh data.root) or fix its labels"
        )
    labels = torch.as_tensor(targets, dtype=torch.int64)
    if len(labels) != len(images):
        raise DataError(f"{folder} has images {tuple(images.shape)} and {len(labels)} labels: expected (N, 3, 32, 32) and N")
    return CifarSplit(images, labels, classes)

"""Tiny fake CIFAR datasets in the real on-disk format, for tests.

The files are protocol-2 pickles whose strings are written as Python 2 `str`
objects, like the files published by the dataset authors. That matters: the
same file then reads back with `encoding="latin1"` (what torchvision does:
keys are 'data', 'fine_labels', ...) and with `encoding="bytes"` (what the
dataset's own web page does: keys are b'data', b'fine_labels', ...).

torchvision and rptrain check every file against the published md5s (on the
dataset class, in rptrain.data.cifar.FORMATS), so `patch_cifar_checksums` swaps
in the md5s of the files written here; both then load the fake data with download=False.

Usage from a test (tests/ is on sys.path under pytest's default import mode):

    from cifar_fixture import write_fake_cifar, patch_cifar_checksums
    root = write_fake_cifar(tmp_path, "cifar100", n_train=200, n_test=100)
    patch_cifar_checksums(monkeypatch, root, "cifar100")
"""
from __future__ import annotations

import contextlib
import hashlib
import pickle
import struct
from pathlib import Path
from typing import Iterator

import numpy as np

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


class _Py2Pickler(pickle._Pickler):
    """Writes str and bytes as Python 2 strings (SHORT_BINSTRING/BINSTRING).

    Uses the pure-Python pickler because its dispatch table can be extended;
    the C pickler has no hook for emitting different opcodes for str.
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_string(self, obj: str | bytes) -> None:
        raw = obj.encode("latin1") if isinstance(obj, str) else bytes(obj)
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = save_py2_string
    dispatch[bytes] = save_py2_string


def _dump(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        _Py2Pickler(f, protocol=2).dump(obj)


def _images(labels: np.ndarray, num_classes: int, rng: np.random.Generator, class_colors: np.ndarray) -> np.ndarray:
    """(N, 3072) uint8 rows in CIFAR's channel-major layout: a per-class colour plus noise."""
    noise = rng.normal(0.0, 25.0, size=(len(labels), 3, 32, 32))
    # A class-dependent gradient on top of the colour keeps classes apart even when colours are close.
    ramp = np.linspace(-1.0, 1.0, 32)
    direction = (labels % 4)[:, None, None, None]
    grad = np.where(direction == 0, ramp[None, None, :, None], ramp[None, None, None, :]) * 30.0
    grad = np.where(direction >= 2, -grad, grad)
    img = class_colors[labels][:, :, None, None] + grad + noise
    return np.clip(np.rint(img), 0, 255).astype(np.uint8).reshape(len(labels), 3072)


def write_fake_cifar(
    root: str | Path,
    kind: str = "cifar100",
    n_train: int = 200,
    n_test: int = 100,
    seed: int = 0,
) -> Path:
    """Write a small CIFAR-10 or CIFAR-100 under `root` and return `root`.

    Images depend on the label (class colour + gradient + noise), so a tiny
    model can learn them. Labels cycle through all classes before shuffling
    so every class appears when n >= num_classes.
    """
    if kind not in FOLDERS:
        raise ValueError(f"kind must be 'cifar10' or 'cifar100', got {kind!r}")
    root = Path(root)
    folder = root / FOLDERS[kind]
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    num_classes = 10 if kind == "cifar10" else 100
    class_colors = rng.uniform(40, 215, size=(num_classes, 3))

    def split(n: int, prefix: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
        labels = rng.permutation(np.arange(n) % num_classes)
        names = [f"{prefix}_{i:05d}.png" for i in range(n)]
        return _images(labels, num_classes, rng, class_colors), labels, names

    if kind == "cifar100":
        for name, n in (("train", n_train), ("test", n_test)):
            data, fine, filenames = split(n, name)
            _dump(
                {
                    "filenames": filenames,
                    "batch_label": f"{name}ing batch 1 of 1",
                    "fine_labels": [int(x) for x in fine],
                    "coarse_labels": [int(x) // 5 for x in fine],
                    "data": data,
                },
                folder / name,
            )
        _dump(
            {
                "fine_label_names": [f"fine_{i:03d}" for i in range(100)],
                "coarse_label_names": [f"coarse_{i:02d}" for i in range(20)],
            },
            folder / "meta",
        )
    else:
        data, labels, filenames = split(n_train, "train")
        for i, part in enumerate(np.array_split(np.arange(n_train), 5), start=1):
            _dump(
                {
                    "batch_label": f"training batch {i} of 5",
                    "labels": [int(labels[j]) for j in part],
                    "data": data[part],
                    "filenames": [filenames[j] for j in part],
                },
                folder / f"data_batch_{i}",
            )
        data, labels, filenames = split(n_test, "test")
        _dump(
            {
                "batch_label": "testing batch 1 of 1",
                "labels": [int(x) for x in labels],
                "data": data,
                "filenames": filenames,
            },
            folder / "test_batch",
        )
        _dump({"num_cases_per_batch": max(1, n_train // 5), "label_names": CIFAR10_NAMES, "num_vis": 3072}, folder / "batches.meta")
    return root


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _checksum_attrs(root: str | Path, kind: str) -> tuple[type, dict[str, object]]:
    from torchvision.datasets import CIFAR10, CIFAR100

    cls = CIFAR10 if kind == "cifar10" else CIFAR100
    folder = Path(root) / cls.base_folder
    attrs = {
        "train_list": [[name, _md5(folder / name)] for name, _ in cls.train_list],
        "test_list": [[name, _md5(folder / name)] for name, _ in cls.test_list],
        "meta": {**cls.meta, "md5": _md5(folder / cls.meta["filename"])},
    }
    return cls, attrs


def _our_format(root: str | Path, kind: str):
    """rptrain's record of the files (rptrain.data.cifar.FORMATS) with the md5s of the files under `root`."""
    import dataclasses

    from rptrain.data.cifar import FORMATS

    fmt = FORMATS[kind]
    folder = Path(root) / fmt.folder
    ours = lambda files: tuple((name, _md5(folder / name)) for name, _ in files)  # noqa: E731
    return FORMATS, dataclasses.replace(fmt, train=ours(fmt.train), test=ours(fmt.test), meta=ours([fmt.meta])[0])


@contextlib.contextmanager
def _patched(cls: type, attrs: dict[str, object], formats: dict, kind: str, fmt: object) -> Iterator[None]:
    missing = object()
    saved = {k: cls.__dict__.get(k, missing) for k in attrs}
    saved_format = formats[kind]
    try:
        for k, v in attrs.items():
            setattr(cls, k, v)
        formats[kind] = fmt
        yield
    finally:
        formats[kind] = saved_format
        for k, v in saved.items():
            if v is missing:
                delattr(cls, k)
            else:
                setattr(cls, k, v)


def patch_cifar_checksums(monkeypatch, root: str | Path, kind: str = "cifar100"):
    """Make torchvision's CIFAR class for `kind` and rptrain's record of its files accept the files under `root`.

    With pytest's `monkeypatch`, patches now (undone at test teardown) and
    returns None; with None, returns a context manager that patches on entry.
    """
    cls, attrs = _checksum_attrs(root, kind)
    formats, fmt = _our_format(root, kind)
    if monkeypatch is None:
        return _patched(cls, attrs, formats, kind, fmt)
    for k, v in attrs.items():
        monkeypatch.setattr(cls, k, v)
    monkeypatch.setitem(formats, kind, fmt)
    return None


def fake_cifar(tmp_path: Path, monkeypatch, kind: str = "cifar100", **kwargs) -> Path:
    """write_fake_cifar + patch_cifar_checksums in one call; returns the root."""
    root = write_fake_cifar(tmp_path, kind, **kwargs)
    patch_cifar_checksums(monkeypatch, root, kind)
    return root

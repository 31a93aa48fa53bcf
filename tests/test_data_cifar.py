"""CIFAR loading through torchvision's real dataset classes, on fake data in the real file format."""
import pickle
import urllib.error

import numpy as np
import pytest
import torch

from cifar_fixture import FOLDERS, fake_cifar, patch_cifar_checksums, write_fake_cifar
from rptrain.data import CIFAR_STATS, DataError, cifar_dataset, load_cifar


@pytest.mark.parametrize("kind,num_classes", [("cifar100", 100), ("cifar10", 10)])
def test_real_classes_load_fake_data(tmp_path, monkeypatch, kind, num_classes):
    root = fake_cifar(tmp_path, monkeypatch, kind, n_train=120, n_test=40)
    train = load_cifar(kind, root, train=True)
    test = load_cifar(kind, root, train=False)
    assert train.images.shape == (120, 3, 32, 32) and train.images.dtype == torch.uint8
    assert train.images.is_contiguous()
    assert train.labels.shape == (120,) and train.labels.dtype == torch.int64
    assert test.images.shape == (40, 3, 32, 32)
    assert len(train.classes) == num_classes
    assert int(train.labels.min()) >= 0 and int(train.labels.max()) < num_classes

    # NCHW images are the channel-major rows of the pickles, unchanged.
    first = "train" if kind == "cifar100" else "data_batch_1"
    with open(root / FOLDERS[kind] / first, "rb") as f:
        entry = pickle.load(f, encoding="bytes")  # the dataset web page's recipe: bytes keys
    rows = entry[b"data"]
    labels = entry[b"fine_labels" if kind == "cifar100" else b"labels"]
    assert torch.equal(train.images[: len(rows)].reshape(len(rows), -1), torch.from_numpy(rows))
    assert train.labels[: len(labels)].tolist() == labels


def test_fake_images_depend_on_class(tmp_path, monkeypatch):
    root = fake_cifar(tmp_path, monkeypatch, "cifar10", n_train=300, n_test=100)
    train, test = load_cifar("cifar10", root, True), load_cifar("cifar10", root, False)
    feats = lambda x: x.float().mean(dim=(2, 3))  # noqa: E731  per-channel mean colour
    centroids = torch.stack([feats(train.images[train.labels == c]).mean(0) for c in range(10)])
    pred = torch.cdist(feats(test.images), centroids).argmin(1)
    assert (pred == test.labels).float().mean() > 0.5  # chance is 0.1


def test_unchecked_copy_loads_without_patching(tmp_path):
    root = write_fake_cifar(tmp_path, "cifar100", n_train=30, n_test=10)
    with pytest.raises(DataError, match="integrity check.*verify_checksums=false"):
        load_cifar("cifar100", root, train=True)  # md5s differ from the published files
    split = load_cifar("cifar100", root, train=True, verify_checksums=False)
    assert split.images.shape == (30, 3, 32, 32)
    # Pointing root at the inner folder is forgiven.
    assert len(load_cifar("cifar100", root / "cifar-100-python", train=False, verify_checksums=False).labels) == 10


def test_context_manager_patch_is_undone(tmp_path):
    from torchvision.datasets import CIFAR10

    root = write_fake_cifar(tmp_path, "cifar10", n_train=20, n_test=10)
    before = CIFAR10.train_list
    with patch_cifar_checksums(None, root, "cifar10"):
        assert len(load_cifar("cifar10", root, train=True).labels) == 20
    assert CIFAR10.train_list is before


@pytest.mark.parametrize("kind,folder,title", [("cifar100", "cifar-100-python", "CIFAR-100"), ("cifar10", "cifar-10-batches-py", "CIFAR-10")])
def test_missing_dataset_error(tmp_path, kind, folder, title):
    with pytest.raises(DataError) as info:
        load_cifar(kind, tmp_path / "nowhere", train=True, download=False)
    msg = str(info.value)
    assert msg == (
        f"{title} not found under {tmp_path / 'nowhere'}: set data.root to a folder containing {folder}/ or data.download=true"
    )


def test_download_failure_is_one_line(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr("torchvision.datasets.cifar.download_and_extract_archive", offline)
    with pytest.raises(DataError, match=r"CIFAR-100 download to .* failed .*URLError.*data.root") as info:
        load_cifar("cifar100", tmp_path, train=True, download=True)
    assert "\n" not in str(info.value)


def test_bad_name_and_root(tmp_path):
    with pytest.raises(DataError, match="data.name must be"):
        load_cifar("cifar1000", tmp_path)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(DataError, match="is a file"):
        load_cifar("cifar10", a_file)


def test_malformed_file_is_reported(tmp_path):
    root = write_fake_cifar(tmp_path, "cifar100", n_train=20, n_test=10)
    (root / "cifar-100-python" / "train").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="could not read CIFAR-100"):
        load_cifar("cifar100", root, train=True, verify_checksums=False)


def test_stats_and_dataset_object(tmp_path, monkeypatch):
    assert CIFAR_STATS["cifar100"] == ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
    assert CIFAR_STATS["cifar10"] == ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    root = fake_cifar(tmp_path, monkeypatch, "cifar100", n_train=20, n_test=10)
    ds = cifar_dataset("cifar100", root, train=True, transform=np.asarray)
    img, label = ds[0]
    assert img.shape == (32, 32, 3) and isinstance(label, int)

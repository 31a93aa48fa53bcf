"""CIFAR loading (rptrain's reader, and torchvision's real dataset classes as its reference), on fake data in the real file format."""
import pickle
import subprocess
import sys
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
        f"{title} not found under {tmp_path / 'nowhere'}: set data.root to a folder containing {folder}/, or data.download=true, "
        "or use data=synthetic"
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


@pytest.mark.parametrize("kind", ["cifar100", "cifar10"])
def test_our_reader_matches_torchvision(tmp_path, monkeypatch, kind):
    """load_cifar reads the pickles itself: the same images, labels and class names as torchvision's dataset."""
    root = fake_cifar(tmp_path, monkeypatch, kind, n_train=60, n_test=20)
    for train in (True, False):
        ours, theirs = load_cifar(kind, root, train=train), cifar_dataset(kind, root, train=train)
        assert torch.equal(ours.images, torch.from_numpy(theirs.data).permute(0, 3, 1, 2))
        assert ours.labels.tolist() == list(theirs.targets) and ours.classes == list(theirs.classes)


def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path):
    """A data file is data: a pickle naming anything but numpy's array reconstruction is a DataError, not a call."""
    root = write_fake_cifar(tmp_path, "cifar100", n_train=20, n_test=10)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    with open(root / "cifar-100-python" / "test", "wb") as f:
        pickle.dump({"data": Payload(), "fine_labels": []}, f, protocol=2)
    with pytest.raises(DataError, match=r"could not read CIFAR-100 .*names (__builtin__|builtins)\.exec") as info:
        load_cifar("cifar100", root, train=False, verify_checksums=False)
    assert not marker.exists() and "\n" not in str(info.value)


def test_reading_cifar_does_not_import_torchvision(tmp_path):
    """The preflight check and the tensor pipeline's reading import neither torchvision nor torch._dynamo."""
    root = write_fake_cifar(tmp_path, "cifar10", n_train=20, n_test=10)
    code = ("import sys; from rptrain.data.cifar import load_cifar; from rptrain.train.validate import _check_cifar; "
            f"_check_cifar('cifar10', {str(root)!r}, False, False); load_cifar('cifar10', {str(root)!r}, True, verify_checksums=False); "
            "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

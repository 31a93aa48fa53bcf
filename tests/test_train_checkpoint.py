"""Checkpoint files: atomic replacement, checksums, keep-last-N, write errors, fingerprints, RNG states."""
from __future__ import annotations

import errno
import random
import struct
import zipfile

import pytest
import torch

from rptrain.train import checkpoint as ckpt
from rptrain.train.errors import CheckpointError, OutputError
from rptrain.train.resume import resolve_resume
from rptrain.train.model import fingerprint

FP = {"model": "resnet18", "params": 10, "shapes": "abc"}


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP, "model": {"w": torch.arange(3.0)}, "step": 7})
    state = ckpt.load_checkpoint(path, FP)
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(3.0))
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary file left


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP, "step": 1})

    def broken_save(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise RuntimeError("something else broke")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="something else"):
        ckpt.save_checkpoint(path, {"fingerprint": FP, "step": 2})
    monkeypatch.undo()
    assert ckpt.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def full_disk(monkeypatch, full) -> None:
    """Checkpoint files whose writes fail with ENOSPC once `full(file)` says the disk is full."""

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if full(self.f):
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    real_init = ckpt._Writer.__init__
    monkeypatch.setattr(ckpt._Writer, "__init__", lambda self, f: real_init(self, FullDisk(f)))


def test_a_full_disk_is_one_line_naming_the_file_and_the_cause(tmp_path, monkeypatch):
    """torch.save turns the file's OSError into "enforce fail ... unexpected pos": the error names ENOSPC instead."""
    directory = tmp_path / "checkpoints"
    ckpt.save_rotating(directory, {"w": torch.zeros(1000)}, 4, keep=2)

    full_disk(monkeypatch, lambda f: f.tell() > 100)
    with pytest.raises(OutputError) as info:
        ckpt.save_rotating(directory, {"w": torch.ones(1000)}, 8, keep=2)
    message = str(info.value)
    assert str(directory / "step-00000008.pt") in message and "No space left on device (ENOSPC)" in message
    assert "enforce" not in message and "\n" not in message
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000004.pt"]  # no temporary file
    assert torch.equal(ckpt.load_checkpoint(directory / "last.pt")["w"], torch.zeros(1000))


def test_keep_last_n_and_last_pt_is_the_newest(tmp_path):
    directory = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        ckpt.save_rotating(directory, {"step": step}, step, keep=2)
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000006.pt", "step-00000008.pt"]
    assert ckpt.load_checkpoint(directory / "last.pt")["step"] == 8
    assert (directory / "last.pt").stat().st_ino == (directory / "step-00000008.pt").stat().st_ino  # a second name, not a copy


def flip_tensor_bytes(path, offset=40):
    """Flip bytes inside the first tensor's data record of a torch.save zip file (not its pickle or headers)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > offset + 8)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len + offset)
        data = f.read(4)
        f.seek(-4, 1)
        f.write(bytes(b ^ 0xFF for b in data))


def test_flipped_bytes_in_tensor_data_are_refused(tmp_path):
    path = tmp_path / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP, "model": {"w": torch.randn(1000)}})
    clean = torch.load(path, weights_only=True)["model"]["w"]
    flip_tensor_bytes(path)
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["w"], clean)  # torch alone would load it
    with pytest.raises(CheckpointError, match="fails its checksum"):
        ckpt.load_checkpoint(path, FP)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    run = tmp_path / "run"
    for step in (4, 8):
        ckpt.save_rotating(run / "checkpoints", {"step": step, "w": torch.randn(1000)}, step, keep=2)
    flip_tensor_bytes(run / "checkpoints" / "step-00000008.pt")
    choice = resolve_resume(str(run), tmp_path, None, [])
    assert choice.path == run / "checkpoints" / "step-00000004.pt"
    assert "step-00000008.pt fails its checksum" in choice.note() and "resuming from" in choice.note()
    flip_tensor_bytes(run / "checkpoints" / "step-00000004.pt")
    with pytest.raises(CheckpointError, match="no checkpoint passes verification"):
        resolve_resume(str(run), tmp_path, None, [])
    with pytest.raises(CheckpointError, match="fails its checksum"):  # a file named explicitly: refused, no fallback
        ckpt.load_checkpoint(resolve_resume(str(run / "checkpoints" / "last.pt"), tmp_path, None, []).path)


def test_fingerprint_mismatch_names_both_models(tmp_path):
    path = tmp_path / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP})
    with pytest.raises(CheckpointError, match=r"resnet18 \(10 parameters\).*builds resnet34 \(20 parameters\)"):
        ckpt.load_checkpoint(path, {"model": "resnet34", "params": 20, "shapes": "abc"})
    with pytest.raises(CheckpointError, match="other layer shapes"):
        ckpt.load_checkpoint(path, {**FP, "shapes": "xyz"})


def test_corrupt_and_truncated_files(tmp_path):
    good = tmp_path / "good.pt"
    ckpt.save_checkpoint(good, {"fingerprint": FP, "model": {"w": torch.randn(1000)}})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:2000])
    for path in (cut, tmp_path / "missing.pt"):
        with pytest.raises(CheckpointError, match=str(path)):
            ckpt.load_checkpoint(path)


def test_fingerprint_follows_shapes_not_values():
    a = torch.nn.Sequential(torch.nn.Linear(3, 4))
    b = torch.nn.Sequential(torch.nn.Linear(3, 4))
    c = torch.nn.Sequential(torch.nn.Linear(3, 5))
    assert fingerprint("m", a) == fingerprint("m", b) != fingerprint("m", c)
    assert fingerprint("m", a)["params"] == 16


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(3)
    random.seed(4)
    path = tmp_path / "rng.pt"
    ckpt.save_checkpoint(path, {"rng": ckpt.rng_state()})
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    ckpt.set_rng_state(ckpt.load_checkpoint(path)["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]

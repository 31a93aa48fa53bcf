"""Checkpoint files: atomic replacement, fingerprints, corrupt files, RNG states."""
from __future__ import annotations

import random

import pytest
import torch

from rptrain.train import checkpoint as ckpt
from rptrain.train.errors import CheckpointError
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
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(path, {"fingerprint": FP, "step": 2})
    monkeypatch.undo()
    assert ckpt.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


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

"""Which checkpoint trainer.resume picks."""
from __future__ import annotations

import os
import time

import pytest
import yaml

from rptrain.train.errors import CheckpointError
from rptrain.train.resume import job_key, resolve_resume


def make_run(root, name, overrides, checkpoint=True, age=0.0):
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    if checkpoint:
        path = run / "checkpoints" / "last.pt"
        path.parent.mkdir()
        path.write_bytes(b"x")
        stamp = time.time() - age
        os.utime(path, (stamp, stamp))
    return run


def test_job_key_ignores_resume_and_order():
    assert job_key(["b=1", "trainer.resume=auto", "a=2"]) == job_key(["a=2", "b=1"]) == ("a=2", "b=1")
    assert job_key(["+trainer.resume=x", "a=2"]) == ("a=2",)


def test_auto_picks_the_newest_run_with_the_same_overrides(tmp_path):
    ours = ["model=resnet18", "trainer.max_steps=9"]
    make_run(tmp_path, "2024-01-01/10-00-00", ours, age=100)
    newer = make_run(tmp_path, "2024-01-02/10-00-00", [*ours, "trainer.resume=auto"], age=10)
    make_run(tmp_path, "2024-01-03/10-00-00", ["model=resnet34"], age=1)  # newest, but another job
    make_run(tmp_path, "2024-01-04/10-00-00", ours, checkpoint=False)  # crashed before a checkpoint
    make_run(tmp_path, "multirun/2024-01-05/10-00-00/0", [*ours, "x=1"], age=0)
    found = resolve_resume("auto", tmp_path, None, [*ours, "trainer.resume=auto"])
    assert found == (newer / "checkpoints" / "last.pt").absolute()


def test_auto_with_nothing_to_resume_starts_fresh(tmp_path):
    assert resolve_resume("auto", tmp_path / "none", None, ["a=1"]) is None
    assert resolve_resume(None, tmp_path, None, []) is None


def test_auto_finds_a_checkpoint_in_a_fixed_run_directory(tmp_path):
    run = make_run(tmp_path / "elsewhere", "job42", ["a=1"])
    assert resolve_resume("auto", tmp_path / "outputs", run, ["a=1"]) == (run / "checkpoints" / "last.pt").absolute()


def test_path_to_a_file_or_run_directory(tmp_path):
    run = make_run(tmp_path, "run", [])
    last = run / "checkpoints" / "last.pt"
    assert resolve_resume(str(last), tmp_path, None, []) == last
    assert resolve_resume(str(run), tmp_path, None, []) == last
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_resume(str(tmp_path / "nope.pt"), tmp_path, None, [])
    with pytest.raises(CheckpointError, match="no checkpoints/last.pt"):
        resolve_resume(str(tmp_path), tmp_path, None, [])

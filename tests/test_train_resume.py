"""Which checkpoint trainer.resume picks: same overrides, newest first, verified, not another live run's."""
from __future__ import annotations

import os
import time

import pytest
import torch
import yaml

from rptrain.train.checkpoint import save_rotating
from rptrain.train.errors import CheckpointError
from rptrain.train.resume import job_key, resolve_resume


def make_run(root, name, overrides, steps=(4,), age=0.0):
    """A run directory as the CLI leaves it: Hydra's overrides.yaml and real checkpoints (step files + last.pt)."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    for i, step in enumerate(steps):
        save_rotating(run / "checkpoints", {"step": step, "w": torch.full((4,), float(step))}, step, keep=2)
        stamp = time.time() - age + i  # each newer than the one before
        os.utime(run / "checkpoints" / f"step-{step:08d}.pt", (stamp, stamp))
    return run


def test_job_key_ignores_resume_and_order():
    assert job_key(["b=1", "trainer.resume=auto", "a=2"]) == job_key(["a=2", "b=1"]) == ("a=2", "b=1")
    assert job_key(["+trainer.resume=x", "a=2"]) == ("a=2",)


def test_auto_picks_the_newest_run_with_the_same_overrides(tmp_path):
    ours = ["model=resnet18", "trainer.max_steps=9"]
    make_run(tmp_path, "2024-01-01/10-00-00", ours, age=100)
    newer = make_run(tmp_path, "2024-01-02/10-00-00", [*ours, "trainer.resume=auto"], age=10)
    make_run(tmp_path, "2024-01-03/10-00-00", ["model=resnet34"], age=1)  # newest, but another job
    make_run(tmp_path, "2024-01-04/10-00-00", ours, steps=())  # crashed before a checkpoint
    make_run(tmp_path, "multirun/2024-01-05/10-00-00/0", [*ours, "x=1"], age=0)
    choice = resolve_resume("auto", tmp_path, None, [*ours, "trainer.resume=auto"])
    assert choice.path == (newer / "checkpoints" / "step-00000004.pt").absolute()
    assert choice.run_dir == newer.absolute() and choice.note() is None


def test_auto_with_nothing_to_resume_starts_fresh(tmp_path):
    assert resolve_resume("auto", tmp_path / "none", None, ["a=1"]).path is None
    assert resolve_resume(None, tmp_path, None, []).path is None


def test_auto_finds_a_checkpoint_in_a_fixed_run_directory(tmp_path):
    run = make_run(tmp_path / "elsewhere", "job42", ["a=1"])
    assert resolve_resume("auto", tmp_path / "outputs", run, ["a=1"]).path == (run / "checkpoints" / "step-00000004.pt").absolute()


def test_path_to_a_file_or_run_directory(tmp_path):
    run = make_run(tmp_path, "run", [], steps=(4, 8))
    last = run / "checkpoints" / "last.pt"
    assert resolve_resume(str(last), tmp_path, None, []).path == last
    choice = resolve_resume(str(run), tmp_path, None, [])
    assert choice.path == run / "checkpoints" / "step-00000008.pt" and choice.run_dir is None  # a path: the run goes elsewhere
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_resume(str(tmp_path / "nope.pt"), tmp_path, None, [])
    with pytest.raises(CheckpointError, match="no checkpoints/"):
        resolve_resume(str(tmp_path), tmp_path, None, [])

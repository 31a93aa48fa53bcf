"""The checkpoint disk check: sizes against what the writer writes, the refusal, the rotation note."""
from __future__ import annotations

import sys

import pytest
import torch
from test_cli_faults import RUN, run_main, status
from test_cli_helpers import error_lines

from rptrain.train import checkpoint as ckpt
from rptrain.train import disk_check
from rptrain.train.errors import OutputError


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(disk_check.shutil, "disk_usage", lambda p: type("Usage", (), {"free": free})())


def test_predicted_size_matches_the_written_checkpoint(tmp_path):
    """Adam's state predicted before its first step, and measured after it: both within the 1 MiB
    allowance above the file the writer then writes."""
    model = torch.nn.Linear(256, 300).to(torch.bfloat16)
    master = {k: v.float() for k, v in model.state_dict().items()}
    params = [torch.nn.Parameter(t) for t in master.values()]
    opt = torch.optim.AdamW(params)
    before = disk_check.disk_needs(tmp_path / "checkpoints", master, opt, keep=2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    after = disk_check.disk_needs(tmp_path / "checkpoints", master, opt, keep=2)
    ckpt.save_rotating(tmp_path / "checkpoints", {"model": master, "optimizer": opt.state_dict()}, 1, keep=2)
    written = ckpt.checkpoint_nbytes(tmp_path / "checkpoints" / "step-00000001.pt")  # the manifest and its shards
    assert not before.assumed and before.checkpoint - 2**20 <= written <= before.checkpoint
    assert abs(after.checkpoint - before.checkpoint) < 1024  # the step counts


def test_refused_when_not_even_one_checkpoint_fits(tmp_path, monkeypatch):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2**20))])  # 4 MiB master, 8 MiB state
    _free(monkeypatch, 10 * 2**20)
    needs = disk_check.disk_needs(tmp_path, {"w": opt.param_groups[0]["params"][0]}, opt, keep=2)
    with pytest.raises(OutputError, match=r"checkpoints: 13.00 MiB each.*has 10.00 MiB free: not even one checkpoint fits"):
        disk_check.check_disk(needs)
    _free(monkeypatch, 30 * 2**20)
    note = disk_check.check_disk(disk_check.disk_needs(tmp_path, {"w": opt.param_groups[0]["params"][0]}, opt, keep=2))
    assert "only 2 fit: older checkpoints are deleted first" in note
    _free(monkeypatch, 60 * 2**20)
    assert disk_check.check_disk(disk_check.disk_needs(tmp_path, {"w": opt.param_groups[0]["params"][0]}, opt, keep=2)) is None


def test_a_run_whose_checkpoint_cannot_fit_stops_before_its_first_step(tmp_path, monkeypatch, capsys):
    """One line with the numbers, exit 2, nothing trained or written: not a run that dies at its first checkpoint."""
    _free(monkeypatch, 4096)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    run = tmp_path / "short"
    code, out, err = run_main([*RUN, f"hydra.run.dir={run}"], capsys)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "not even one checkpoint fits" in lines[0] and "4.00 KiB free" in lines[0] and "trainer.keep_checkpoints=2" in lines[0]
    assert status(run)["state"] == "failed" and not (run / "checkpoints").exists()


def test_older_checkpoints_count_with_their_shards(tmp_path, monkeypatch):
    """What rotation can free is the older checkpoints' manifests and every shard they name."""
    monkeypatch.setattr(ckpt.layout, "SHARD_BYTES", 4096)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(10))], lr=0.1)
    for step in (1, 2):
        ckpt.save_rotating(tmp_path / "checkpoints", {f"w{i}": torch.randn(1000) for i in range(5)}, step, keep=2)
    older = tmp_path / "checkpoints" / "step-00000001.pt"
    assert len(ckpt.layout.shard_files(older)) == 5
    needs = disk_check.disk_needs(tmp_path / "checkpoints", {"w": torch.zeros(10)}, opt, keep=2)
    assert needs.older == ckpt.checkpoint_nbytes(older) > 5000 * 4

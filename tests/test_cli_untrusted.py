"""Untrusted configuration: paths that would leave the run directory are refused with one line, and a value
from the environment (an API key) is stored as its interpolation, never resolved, wherever the run writes
its config down; a disk that fills while the run ends is one line and a final status."""
from __future__ import annotations

import errno
import json

import pytest
import torch
from test_cli_helpers import TINY, error_lines, explain, rptrain_here

from rptrain.train.checkpoint import load_checkpoint


@pytest.mark.parametrize("override", ["hydra.job.name=../../x", "hydra.output_subdir=../../y", "hydra.output_subdir=/tmp/y"])
def test_hydra_paths_outside_the_run_directory_are_refused(tmp_path, override):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    proc = rptrain_here([*TINY, "trainer.max_steps=1", override, f"hydra.run.dir={work / 'run'}"], work)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and override.split("=")[0] in lines[0], explain(proc)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]


def test_environment_values_never_land_resolved_in_the_run_s_files(tmp_path, monkeypatch):
    secret = "sk-4f9a77e1c0ffee"
    monkeypatch.setenv("RPTRAIN_TEST_API_KEY", secret)
    run = tmp_path / "run"
    proc = rptrain_here([*TINY, "trainer.max_steps=2", "logger=[jsonl,mlflow]", "output_root=${oc.env:RPTRAIN_TEST_API_KEY}",
                         f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert "${oc.env:RPTRAIN_TEST_API_KEY}" in proc.stdout and secret not in proc.stdout + proc.stderr
    written = [p for p in run.rglob("*") if p.is_file() and p.suffix != ".pt"]
    assert any("mlruns" in p.parts for p in written)
    leaked = [p for p in written if secret.encode() in p.read_bytes()]
    assert leaked == [], leaked
    config = load_checkpoint(run / "checkpoints" / "last.pt")["config"]
    assert config["output_root"] == "${oc.env:RPTRAIN_TEST_API_KEY}" and secret not in repr(config)


def test_disk_full_while_writing_the_summary_is_one_line_and_a_final_status(tmp_path, monkeypatch):
    from rptrain.cli import job

    real = job.write_json_atomic

    def full(path, data):
        if path.name == "summary.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(job, "write_json_atomic", full)
    run = tmp_path / "run"
    proc = rptrain_here([*TINY, "trainer.max_steps=2", f"hydra.run.dir={run}"], tmp_path)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "summary.json" in lines[0] and "No space left" in lines[0], explain(proc)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "No space left" in status["error"]
    assert (run / "checkpoints" / "last.pt").is_file()  # the trained weights are kept


def test_status_is_final_even_when_no_new_file_fits(tmp_path, monkeypatch):
    from rptrain.train import status as status_module

    status_module.write_status(tmp_path, "running", pid=1)

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(status_module, "write_json_atomic", full)
    status_module.write_status(tmp_path, "failed", error="disk full")
    assert status_module.read_status(tmp_path)["state"] == "failed"


def test_disk_full_while_hydra_writes_its_folder_is_one_line(tmp_path, monkeypatch):
    from hydra.core import utils as hydra_utils

    def full(cfg, filename, output_dir):
        raise OSError(errno.ENOSPC, "No space left on device", str(output_dir / filename))

    monkeypatch.setattr(hydra_utils, "_save_config", full)
    proc = rptrain_here([*TINY, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and ".hydra" in lines[0] and "No space left" in lines[0], explain(proc)


def test_a_sweep_job_whose_directory_cannot_be_created_fails_alone(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "1").write_text("a file where job 1's directory goes")
    proc = rptrain_here(["-m", *TINY, "trainer.max_steps=1", "trainer.seed=0,1,2", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, explain(proc)
    assert any(line.startswith("rptrain: error: job 1: cannot write") for line in error_lines(proc.stderr)), explain(proc)
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed"), ("1", "failed"), ("2", "completed")], rows
    assert "cannot write" in rows[1]["error"] and rows[1]["overrides"][-1] == "trainer.seed=1"

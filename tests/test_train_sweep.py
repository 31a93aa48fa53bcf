"""The sweep summary: one row per job, from summary.json or, for unfinished jobs, status.json."""
from __future__ import annotations

import json

import yaml
from rich.console import Console

from rptrain.train.status import write_status
from rptrain.train.sweep import SweepSummary, job_row, sweep_table, varying, write_sweep_summary


def _job(root, num, overrides, summary=None):
    d = root / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary:
        (d / "summary.json").write_text(json.dumps({"status": "completed", "overrides": overrides, **summary}))
    else:
        write_status(d, "failed", error="boom")
    return d


def test_rows_table_and_files(tmp_path):
    common = ["model=resnet18"]
    dirs = [
        _job(tmp_path, 0, [*common, "run_config.num_microbatch=1"], {"final": {"test_loss": 1.5, "test_acc": 0.5}, "steps": 4, "samples_per_s": 100.0}),
        _job(tmp_path, 1, [*common, "run_config.num_microbatch=2"]),
    ]
    rows = [job_row(d) for d in dirs]
    assert rows[0]["test_acc"] == 0.5 and rows[1]["status"] == "failed" and rows[1]["overrides"][-1].endswith("=2")
    assert varying(rows) == [["run_config.num_microbatch=1"], ["run_config.num_microbatch=2"]]
    write_sweep_summary(tmp_path, rows)
    assert len(json.loads((tmp_path / "sweep_summary.json").read_text())) == 2
    assert (tmp_path / "sweep_summary.csv").read_text().count("\n") == 3
    console = Console(width=200, record=True)
    console.print(sweep_table(rows))
    text = console.export_text()
    assert "run_config.num_microbatch=2" in text and "failed" in text and "1.5000" in text


def test_callback_finds_the_jobs_in_the_sweep_folder_and_fails_the_sweep_for_a_failed_job(tmp_path, capsys):
    """The jobs are found on disk (a launcher such as submitit runs them in other processes); a failed
    job makes the sweep exit 1 after the summary, with one line naming the job and its reason."""
    import pytest
    from omegaconf import OmegaConf

    _job(tmp_path, 0, ["a=1"], {"final": {"test_loss": 1.0}, "steps": 1, "samples_per_s": 1.0})
    (tmp_path / ".submitit").mkdir()  # not a job: no .hydra/
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    SweepSummary().on_multirun_end(config)
    assert len(json.loads((tmp_path / "sweep_summary.json").read_text())) == 1 and "sweep summary" in capsys.readouterr().out
    _job(tmp_path, 10, ["a=3"])
    _job(tmp_path, 2, ["a=2"], {"final": {"test_loss": 2.0}, "steps": 1, "samples_per_s": 1.0})
    with pytest.raises(SystemExit) as exit_info:
        SweepSummary().on_multirun_end(config)
    assert exit_info.value.code == 1
    rows = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [r["job"] for r in rows] == ["0", "2", "10"] and rows[2]["status"] == "failed" and rows[2]["error"] == "boom"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 of 3 sweep jobs did not complete (job 10 failed: boom)" in err[0]

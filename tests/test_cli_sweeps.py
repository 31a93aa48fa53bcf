"""Sweeps that keep going: a failing job, Optuna's sampler, submitit's launcher; and the run's
first lines off a terminal (the precision=auto line, a step line before log_interval, the config
in rptrain.log, TensorBoard scalars equal to metrics.jsonl)."""
from __future__ import annotations

import json

import pytest
import yaml
from test_cli_helpers import TINY, error_lines, explain, read_jsonl, rptrain, rptrain_here

from rptrain.cli.main import main

# Two steps of a tiny ResNet; lr 1e10 makes the loss non-finite by step 3, a failure only the run can find.
SMALL = [o for o in TINY if o != "precision=fp32"] + ["data.num_train=32", "data.num_test=16", "trainer.max_steps=3"]


def _sweep_dir(root):
    [sweep] = list(root.glob("multirun/*/*"))
    return sweep, json.loads((sweep / "sweep_summary.json").read_text())


def test_a_failing_job_lets_the_others_run_and_the_sweep_exits_1(tmp_path):
    proc = rptrain_here(["-m", *SMALL, "trainer.log_interval=100", "optim.optimizer.lr=1e10,1e-3", "logger=[jsonl,tensorboard]",
                    f"output_root={tmp_path}"], tmp_path)
    assert proc.returncode == 1, explain(proc)
    sweep, rows = _sweep_dir(tmp_path)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "completed")], explain(proc)
    assert rows[0]["error"] and rows[1]["steps"] == 3 and rows[1]["test_loss"] > 0
    assert error_lines(proc.stderr)[-1] == (f"rptrain: error: 1 of 2 sweep jobs did not complete (job 0 failed: {rows[0]['error']}): "
                                            f"see {sweep / 'sweep_summary.json'}"), explain(proc)
    assert "failed" in (sweep / "sweep_summary.csv").read_text()

    # The completed job, off a terminal: precision=auto said what it chose, a step line came before
    # the first log_interval step, rptrain.log holds the config, TensorBoard holds metrics.jsonl's values.
    job = sweep / "1"
    assert "precision=auto: float32 compute (no CUDA device" in proc.stdout
    assert "Epoch 1/2: 1/2 | loss " in proc.stdout and " samples/s" in proc.stdout, explain(proc)
    log = (job / "rptrain.log").read_text()
    assert "config:\nmodel:\n" in log and "  batch_size: 16\n" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(job / "tensorboard"))
    events.Reload()
    train = [r for r in read_jsonl(job / "metrics.jsonl") if r["kind"] == "train"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(r["step"], pytest.approx(r["loss"])) for r in train]


def test_optuna_sweep_returns_the_objective_and_writes_the_summary(tmp_path):
    proc = rptrain_here(["-m", *SMALL, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0",
                    "optim.optimizer.lr=tag(log,interval(1e-4,1e-2))", "trainer.objective=test_loss", f"output_root={tmp_path}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    sweep, rows = _sweep_dir(tmp_path)
    assert [r["status"] for r in rows] == ["completed", "completed"]
    lrs = [float(o.split("=")[1]) for r in rows for o in r["overrides"] if o.startswith("optim.optimizer.lr=")]
    assert len(set(lrs)) == 2 and all(1e-4 <= lr <= 1e-2 for lr in lrs)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(r["test_loss"] for r in rows))  # what the jobs returned


@pytest.mark.slow
def test_submitit_local_runs_the_jobs_in_processes_and_still_summarizes(tmp_path):
    proc = rptrain(["-m", *SMALL, "hydra/launcher=submitit_local", "optim.optimizer.lr=1e10,1e-3", f"output_root={tmp_path}"],
                   tmp_path, timeout=300)
    assert proc.returncode == 1, explain(proc)
    sweep, rows = _sweep_dir(tmp_path)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "completed")], explain(proc)
    assert rows[0]["error"] and (sweep / ".submitit").is_dir()


def test_help_lists_every_config_group_and_option(capsys):
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out.split("== Config groups")[1].split("== Config (defaults)")[0]
    conf = Path(__file__).resolve().parents[1] / "conf"
    for group in sorted(p for p in conf.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__")):
        [line] = [line for line in text.splitlines() if line.startswith(f"{group.name}:")]
        assert all(option.stem in line for option in group.glob("*.yaml")), line

"""End-to-end CLI runs as subprocesses: outputs, epoch lines, CIFAR-format data, sweeps."""
from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess

import pytest
import torch
from cifar_fixture import write_fake_cifar
from test_cli_helpers import RECIPE_ENV, ROOT, TEST_ENV, TINY, explain, read_jsonl, rptrain_here, without_groups
from test_seed_tutorial import EPOCH_LINE


def test_run_writes_the_whole_output_layout(tmp_path):
    """Hydra's layout under outputs/ of the working directory, which may be anywhere."""
    work = tmp_path / "somewhere" / "else"
    work.mkdir(parents=True)
    proc = rptrain_here([*TINY, "trainer.epochs=2"], cwd=work)
    assert proc.returncode == 0, explain(proc)
    [run] = [p.parent for p in (work / "outputs").glob("*/*/.hydra")]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", run.parent.name) and re.fullmatch(r"\d\d-\d\d-\d\d", run.name)

    # The tutorial's epoch line, once per epoch.
    lines = [m for m in map(EPOCH_LINE.match, proc.stdout.splitlines()) if m]
    assert [(m[1], m[2]) for m in lines] == [("01", "2"), ("02", "2")], explain(proc)
    # The config tree at the start.
    assert "trainer" in proc.stdout and "batch_size: 16" in proc.stdout

    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.jsonl", "metrics.csv", "curves.png",
                 "checkpoints/last.pt", "summary.json", "status.json", "rptrain.log"):
        assert (run / name).is_file(), name
    assert not list((run / "checkpoints").glob(".*tmp*")), "a temporary checkpoint file was left behind"

    records = read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    for r in train:
        for key in ("step", "epoch", "loss", "acc", "lr", "loss_scale", "samples_per_s", "data_time", "step_time"):
            assert r[key] is not None, (key, r)
        assert r["samples_per_s"] > 0 and r["data_time"] >= 0 and r["step_time"] > 0
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8] and all(0 <= r["acc"] <= 1 for r in evals)
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert train[-1]["loss"] < train[0]["loss"] + 0.5  # nothing diverged

    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) and {"step", "loss", "acc", "lr", "samples_per_s", "data_time"} <= set(rows[0])

    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 8 and summary["epochs"] == 2
    assert set(summary["final"]) == {"train_loss", "train_acc", "test_loss", "test_acc"}
    assert summary["final"]["test_loss"] == pytest.approx(evals[-1]["loss"])
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    # Hydra's record of the job is the composed config.
    assert "resnet18" in (run / ".hydra" / "config.yaml").read_text()
    assert "Epoch 02/2" in (run / "rptrain.log").read_text()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("rptrain") is None, reason="the rptrain console script is not installed")
def test_console_script_prints_the_resolved_config(tmp_path):
    proc = subprocess.run(["rptrain", "--cfg", "job", "model=resnet50", "optim=adamw"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=TEST_ENV)
    assert proc.returncode == 0, explain(proc)
    assert "name: resnet50" in proc.stdout and "rptrain.optim.AdamW" in proc.stdout
    assert "num_classes: 100" in proc.stdout and "num_microbatch" in proc.stdout and "warmup_steps" in proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_cifar_format_dataset_both_pipelines_in_one_sweep(tmp_path):
    """A CIFAR-100 in the real file format, read through torchvision: the in-memory tensor
    pipeline and the tutorial's per-sample torchvision pipeline, as two jobs of one -m sweep;
    with the tutorial's fp16 + GradScaler and AdamW's warmup + cosine schedule."""
    root = write_fake_cifar(tmp_path / "cifar", "cifar100", n_train=64, n_test=32)
    sweep = tmp_path / "sweep"
    args = [a for a in TINY if not a.startswith(("data", "precision"))]
    proc = rptrain_here(
        ["-m", *args, "data=cifar100", f"data.root={root}", "data.download=false", "data.verify_checksums=false",
         "data.pipeline=tensor,torchvision", "trainer.num_workers=0", "trainer.epochs=1", "precision=fp16",
         "optim=adamw", "optim.schedule.warmup_steps=2", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, explain(proc)
    assert "Warning" not in proc.stderr, proc.stderr
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 4, summary
        assert 0 <= summary["final"]["test_acc"] <= 1 and summary["final"]["test_loss"] < 10
        train = [r for r in read_jsonl(sweep / job / "metrics.jsonl") if r["kind"] == "train"]
        lrs = [r["lr"] for r in train]
        assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])  # linear warmup over 2 steps, then cosine over the other 2
        assert all(r["loss_scale"] >= 1 for r in train) and train[0]["loss_scale"] <= 65536
    # data.augment_device=auto: the tensor pipeline augments on the GPU when there is one
    augments_on = "cuda" if torch.cuda.is_available() else "cpu"
    assert "per-sample torchvision transforms" in proc.stdout and f"augmented on {augments_on}" in proc.stdout


@pytest.mark.slow
def test_sweep_recipe_runs_every_job_in_one_process_and_releases_engines(tmp_path):
    """recipes/sweep_num_microbatch.sh as plain bash: `rptrain -m run_config.num_microbatch=1,2,4`."""
    proc = subprocess.run(
        ["bash", str(ROOT / "recipes" / "sweep_num_microbatch.sh"), *without_groups(TINY)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**TEST_ENV, **RECIPE_ENV, "MICROBATCHES": "1,2,4", "STEPS": "4"},
    )
    assert proc.returncode == 0, explain(proc)
    [sweep] = list((tmp_path / "outputs" / "multirun").glob("*/*"))  # outputs/multirun/DATE/TIME
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(3)]
    # Every job closes its engine: no optimizer thread survives a job, and the engine is garbage.
    assert [s["threads_before"] for s in summaries] == [summaries[0]["threads_before"]] * 3
    assert all(s["threads_after"] == s["threads_before"] for s in summaries)
    assert all(s["engine_released"] for s in summaries)

    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert [next(o for o in r["overrides"] if o.startswith("run_config.num_microbatch")) for r in rows] == [
        "run_config.num_microbatch=1", "run_config.num_microbatch=2", "run_config.num_microbatch=4"]
    for row in rows:
        assert row["status"] == "completed" and row["samples_per_s"] > 0 and row["test_loss"] > 0
    with open(sweep / "sweep_summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
    # The table on stdout shows what differs between the jobs.
    assert "sweep summary" in proc.stdout and "run_config.num_microbatch=4" in proc.stdout

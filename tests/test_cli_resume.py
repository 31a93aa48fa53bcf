"""Checkpoint and resume through the CLI: exactness, pre-emption signals, trainer.resume=auto."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_cli_helpers import RECIPE_ENV, ROOT, TEST_ENV, TINY, explain, read_jsonl, rptrain, rptrain_here, train_losses, without_groups

from rptrain.train import checkpoint_layout as ckpt_layout

# 96 images of batch 16: 6 steps per epoch, so step 4 is in the middle of the first epoch.
RESUME = [*TINY, "data.num_train=96", "trainer.checkpoint_interval=4"]


def test_resumed_run_reproduces_the_straight_run(tmp_path):
    """Stopped at step 4 and resumed to step 10 vs straight to step 10 (fp32, async optimizer
    steps): the same losses. Both runs checkpoint, and so synchronize the engine, at step 4."""
    sweep = tmp_path / "sweep"
    proc = rptrain_here(["-m", *RESUME, "trainer.max_steps=4,10", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    short, straight = sweep / "0", sweep / "1"
    assert json.loads((short / "summary.json").read_text())["steps"] == 4

    resumed = tmp_path / "resumed"
    proc = rptrain_here([*RESUME, "trainer.max_steps=10", f"trainer.resume={short}", f"hydra.run.dir={resumed}"], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert f"resumed from {short / 'checkpoints' / 'step-00000004.pt'} at step 4" in proc.stdout

    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    la, lb = train_losses(a), train_losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, 11))  # the resumed run carries the history
    for step in range(1, 11):
        assert lb[step] == pytest.approx(la[step], abs=1e-6, rel=0), step
    # Test metrics at the end and the epoch summary (which spans the resume point) agree too.
    last_eval = lambda records: [r for r in records if r["kind"] == "eval"][-1]  # noqa: E731
    assert last_eval(b)["step"] == 10 and last_eval(b)["loss"] == pytest.approx(last_eval(a)["loss"], abs=1e-6)
    first_epoch = lambda records: next(r for r in records if r["kind"] == "epoch")  # noqa: E731
    assert first_epoch(b)["train_loss"] == pytest.approx(first_epoch(a)["train_loss"], abs=1e-6)
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == str(short / "checkpoints" / "step-00000004.pt") and summary["steps"] == 10


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rptrain.cli.main", *args], cwd=cwd, env=TEST_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(metrics: Path, proc: subprocess.Popen, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and sum('"kind": "train"' in line for line in metrics.read_text().splitlines()) >= steps:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {steps}: {proc.communicate()}")
        time.sleep(0.02)
    raise AssertionError("the run did not reach the step in time")


# One epoch of 160 steps: long enough to be stopped in the middle.
LONG = [*TINY, "data.num_train=2560", "trainer.epochs=1"]


def _run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("outputs/*/*/.hydra"))


@pytest.mark.slow
def test_preemption_through_the_slurm_recipe_then_requeue_resumes(tmp_path):
    """recipes/slurm_resnet34_cifar100.sh as plain bash: SIGTERM to the batch shell (what SLURM's
    --signal=B:TERM does) reaches rptrain, which checkpoints and exits 143 with a resume hint;
    running the recipe again (a requeue) continues from that checkpoint via trainer.resume=auto."""
    recipe = ["bash", str(ROOT / "recipes" / "slurm_resnet34_cifar100.sh"), *without_groups(LONG)]
    env = {**TEST_ENV, **RECIPE_ENV}
    proc = subprocess.Popen(recipe, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _run_dirs(tmp_path) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        [run] = _run_dirs(tmp_path)
        _wait_for_steps(run / "metrics.jsonl", proc, 3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, (out, err)
    message = [line for line in err.splitlines() if "interrupted at step" in line]
    assert len(message) == 1, err
    stopped_at = int(message[0].split("interrupted at step ")[1].split()[0])
    assert f"checkpoint saved to {run / 'checkpoints' / 'last.pt'}" in message[0]
    assert "resume with: rptrain" in message[0] and message[0].rstrip().endswith("trainer.resume=auto")
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and status["step"] == stopped_at
    assert not (run / "summary.json").exists()
    assert max(train_losses(read_jsonl(run / "metrics.jsonl"))) == stopped_at  # finished the step it was in

    again = subprocess.run(recipe, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, explain(again)
    assert _run_dirs(tmp_path) == [run]  # continued in its own directory
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoints" / f"step-{stopped_at:08d}.pt")
    assert summary["steps"] == 160 and summary["epochs"] == 1
    assert sorted(train_losses(read_jsonl(run / "metrics.jsonl"))) == list(range(1, 161))  # the whole history, once
    assert json.loads((run / "status.json").read_text())["state"] == "completed"

    # A finished run started again says so and writes nothing.
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    done = subprocess.run(recipe, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, explain(done)
    assert done.stdout.strip().splitlines()[-1] == f"rptrain: {run} already completed this run (step 160): nothing to do", explain(done)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before and _run_dirs(tmp_path) == [run]


@pytest.mark.slow
def test_sigint_stops_with_130_and_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = _start([*LONG, f"hydra.run.dir={run}"], tmp_path)
    try:
        _wait_for_steps(run / "metrics.jsonl", proc, 2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "SIGINT received" in err and "interrupted at step" in err and "Traceback" not in err
    assert (run / "checkpoints" / "last.pt").is_file()
    assert json.loads((run / "status.json").read_text())["signal"] == "SIGINT"


@pytest.mark.slow
def test_two_runs_in_the_same_second_then_kill_9_and_resume_in_place(tmp_path):
    """Two runs started together get a directory each (neither shares metrics or checkpoints). One is
    killed with SIGKILL mid-run: its status.json still says running and its lock is gone; the same
    command with trainer.resume=auto continues in that directory, marks the dead run interrupted,
    removes the temporary file of a write it cut short, and completes with the whole history."""
    a = [*TINY, "data.num_train=2560", "trainer.max_steps=40", "trainer.checkpoint_interval=2"]
    b = [*TINY, "trainer.max_steps=2", "trainer.seed=1"]
    first, second = _start(a, tmp_path), _start(b, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(tmp_path.glob("outputs/*/*/checkpoints/step-00000004.pt")):  # the first's
            time.sleep(0.01)
        first.kill()  # SIGKILL: no checkpoint, no status, no cleanup
        first.wait()
        assert second.wait(timeout=120) == 0, second.communicate()
    finally:
        first.kill()
        second.kill()
    runs = _run_dirs(tmp_path)
    assert len(runs) == 2, runs
    [killed] = [r for r in runs if not (r / "summary.json").exists()]
    assert json.loads((killed / "status.json").read_text())["state"] == "running"
    (killed / "checkpoints" / ".step-00000099.pt.99999.0123abcd.tmp").write_bytes(b"cut short")

    proc = rptrain([*a, "trainer.resume=auto"], cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert _run_dirs(tmp_path) == runs  # no third directory
    assert "status.json said running but its process is gone: marked killed" in proc.stdout, explain(proc)
    assert "removed 1 temporary file(s)" in proc.stdout
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["resumed_from"].startswith(str(killed / "checkpoints" / "step-"))
    assert sorted(train_losses(read_jsonl(killed / "metrics.jsonl"))) == list(range(1, 41))
    assert sorted(p.name for p in (killed / "checkpoints").glob("*.pt")) == ["last.pt", "step-00000038.pt", "step-00000040.pt"]
    shards = {p.name for p in (killed / "checkpoints").glob("*.shard")}  # only the two kept checkpoints' shards
    assert shards == {s.name for step in (38, 40) for s in ckpt_layout.shard_files(killed / "checkpoints" / f"step-{step:08d}.pt")}


def test_resume_from_a_checkpoint_of_many_shards_is_exact(tmp_path, monkeypatch, capsys):
    """Shards of 64 KiB (dozens per checkpoint), in this process: stopped at step 4 and resumed to step 6
    gives bit for bit the weights and optimizer state of the straight run to step 6."""
    from test_cli_faults import run_main

    from rptrain.train.checkpoint import load_checkpoint

    monkeypatch.setattr(ckpt_layout, "SHARD_BYTES", 64 * 2**10)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    straight, short, resumed = tmp_path / "straight", tmp_path / "short", tmp_path / "resumed"
    for args in ([f"hydra.run.dir={straight}", "trainer.max_steps=6"], [f"hydra.run.dir={short}", "trainer.max_steps=4"],
                 [f"hydra.run.dir={resumed}", "trainer.max_steps=6", f"trainer.resume={short}"]):
        code, out, err = run_main([*RESUME, *args], capsys)
        assert code == 0, err
    assert len(ckpt_layout.shard_files(short / "checkpoints" / "step-00000004.pt")) > 20
    a, b = (load_checkpoint(run / "checkpoints" / "last.pt") for run in (straight, resumed))
    assert a["progress"]["step"] == b["progress"]["step"] == 6
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


# SIGTERM sent by the run to itself at a chosen point of step 3 (after its update, before it is counted).
SIGNAL_IN_STEP = """
import os, signal, sys
from rptrain.train import report
real = report.Report.add_step
def add_step(self, p, *args, **kwargs):
    if p.step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, p, *args, **kwargs)
report.Report.add_step = add_step
from rptrain.cli.main import command
command(sys.argv[1:])
"""


def test_a_signal_between_a_step_and_its_count_resumes_bit_identical(tmp_path):
    """The stop took its checkpoint as step 2 with step 3's weights and data position (the step was taken but
    not yet counted), so the resumed run trained a step twice (issue 31's campaign). Now the step is counted
    inside the signal-deferring window: the stop comes after it, and the resumed run equals the straight one."""
    import torch

    from rptrain.train.checkpoint import load_checkpoint

    # Synchronous steps: with asynchronous ones a checkpoint at step 3 (the straight run has none) changes which
    # weights step 4's gradient sees, by design (test_resumed_run_reproduces_the_straight_run checkpoints both).
    args = [*RESUME, "trainer.max_steps=6", "trainer.checkpoint_interval=100", "trainer.async_step=false"]
    stopped = tmp_path / "stopped"
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_STEP, *args, f"hydra.run.dir={stopped}"], cwd=tmp_path, env=TEST_ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143 and "interrupted at step 3 (SIGTERM)" in proc.stderr, explain(proc)
    resumed = rptrain_here([*args, "trainer.resume=auto", f"hydra.run.dir={stopped}"], cwd=tmp_path)
    straight = rptrain_here([*args, f"hydra.run.dir={tmp_path / 'straight'}"], cwd=tmp_path)
    assert resumed.returncode == 0 and straight.returncode == 0, explain(resumed) + explain(straight)
    a, b = (load_checkpoint(d / "checkpoints" / "last.pt") for d in (stopped, tmp_path / "straight"))
    assert a["progress"]["step"] == b["progress"]["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"]), "the resumed run's weights differ"

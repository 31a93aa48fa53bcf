"""A run directory belongs to one run: another config is refused there before anything is written, a
fresh start over the run's checkpoints is refused, and only the run's own temporary files are removed."""
from __future__ import annotations

import json

import pytest

from test_cli_helpers import TINY, error_lines, explain, rptrain_here


def _snapshot(run):
    return {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}


def test_a_run_directory_belongs_to_one_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    mine = [run / ".notes.tmp", run / "draft.tmp", run / ".status.json.tmp"]  # a user's files, not the run's
    for p in mine:
        p.write_text("keep me")
    a = [*TINY, "trainer.max_steps=2", "trainer.checkpoint_interval=1", f"hydra.run.dir={run}"]
    proc = rptrain_here(a, tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert all(p.read_text() == "keep me" for p in mine)
    before = _snapshot(run)

    other = rptrain_here([*a, "optim.optimizer.lr=0.1"], tmp_path)
    lines = error_lines(other.stderr)
    assert other.returncode == 2 and len(lines) == 1, explain(other)
    assert "holds another run" in lines[0] and "optim.optimizer.lr: 0.001 -> 0.1" in lines[0], lines
    assert _snapshot(run) == before  # its checkpoints, metrics.jsonl and .hydra/ untouched

    again = rptrain_here(a, tmp_path)  # the same run from scratch over its own checkpoints
    lines = error_lines(again.stderr)
    assert again.returncode == 2 and len(lines) == 1 and "trainer.resume=auto" in lines[0] and "step 2" in lines[0], explain(again)
    assert _snapshot(run) == before

    done = rptrain_here([*a, "trainer.resume=auto"], tmp_path)
    assert done.returncode == 0 and "already completed" in done.stdout, explain(done)
    assert _snapshot(run) == before and json.loads((run / "status.json").read_text())["state"] == "completed"


def test_a_sweep_job_directory_of_another_sweep_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    base = ["-m", *TINY, "trainer.max_steps=1", f"hydra.sweep.dir={sweep}"]
    proc = rptrain_here([*base, "trainer.seed=0,1"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    before = _snapshot(sweep)
    other = rptrain_here([*base, "trainer.seed=5"], tmp_path)
    lines = error_lines(other.stderr)
    assert other.returncode == 2 and len(lines) == 1 and "holds another run" in lines[0] and "trainer.seed: 0 -> 5" in lines[0], explain(other)
    assert _snapshot(sweep) == before


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_is_marked_killed_by_the_next(tmp_path):
    import subprocess
    import sys
    import time

    from test_cli_helpers import TEST_ENV

    victim = subprocess.Popen([sys.executable, "-m", "rptrain.cli.main", *TINY, "data.num_train=2560", "trainer.epochs=1"],
                              cwd=tmp_path, env=TEST_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(tmp_path.glob("outputs/*/*/status.json")):
            time.sleep(0.02)
        victim.kill()  # what the kernel's OOM killer does: no status, no cleanup
        victim.wait()
    finally:
        victim.kill()
    [status] = list(tmp_path.glob("outputs/*/*/status.json"))
    assert json.loads(status.read_text())["state"] == "running"
    proc = rptrain_here([*TINY, "trainer.max_steps=1"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    after = json.loads(status.read_text())
    assert after["state"] == "killed" and after["pid"] == victim.pid, after
    assert f"{status.parent}: status.json said running but its process is gone: marked killed" in proc.stdout


@pytest.mark.slow
def test_a_second_resumer_of_a_live_run_says_so_instead_of_starting_over(tmp_path):
    import subprocess
    import sys
    import time

    from test_cli_helpers import TEST_ENV

    args = [*TINY, "data.num_train=2560", "trainer.epochs=1", "trainer.checkpoint_interval=2"]

    def start(extra):
        return subprocess.Popen([sys.executable, "-m", "rptrain.cli.main", *args, *extra], cwd=tmp_path, env=TEST_ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_for(pattern, proc):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(tmp_path.glob(pattern))
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"{pattern} did not appear")

    first = start([])
    try:
        wait_for("outputs/*/*/checkpoints/step-00000002.pt", first)
        first.kill()  # pre-empted
        first.wait()
        second = start(["trainer.resume=auto"])  # the requeue
        run = wait_for("outputs/*/*/checkpoints/step-00000004.pt", second)  # resumed and training
        third = rptrain_here([*args, "trainer.resume=auto"], tmp_path)  # the same job again, while the second runs
        lines = error_lines(third.stderr)
        assert third.returncode == 2 and len(lines) == 1 and "a live process is continuing it" in lines[0], explain(third)
        assert f"pid {second.pid}" in lines[0] and len(list(tmp_path.glob("outputs/*/*/.hydra"))) == 1  # no fresh run
        assert run.parent.parent.name in lines[0]
    finally:
        first.kill()
        if "second" in locals():
            second.kill()
            second.wait()

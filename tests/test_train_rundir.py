"""Run directories: claimed atomically, owned while a run is live, cleaned up when taken over."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys

import pytest
from test_train_resume import make_run

from rptrain.train import checkpoint as ckpt
from rptrain.train import rundir
from rptrain.train.errors import OutputError
from rptrain.train.resume import resolve_resume
from rptrain.train.status import read_status, write_status


def _claim(args):
    path, barrier = args
    barrier.wait()  # every process at the starting line, then all claim the same name at once
    return str(rundir.claim_new(path))


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    path = tmp_path / "outputs" / "2026-01-31" / "14-02-11"
    ctx = multiprocessing.get_context("fork")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            claimed = pool.map(_claim, [(path, barrier)] * 4)
    assert sorted(claimed) == [str(path)] + [f"{path}-{i}" for i in (1, 2, 3)]
    again = rundir.claim_new(path)  # in this process too
    assert again.name == "14-02-11-4" and json.loads((again / rundir.OWNER).read_text())["pid"] == os.getpid()
    rundir.release(again)


# Another rptrain process as far as the owner file is concerned: the same lock, the same record.
HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1] + "/.owner", os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
print("holding", flush=True)
time.sleep(120)
"""


@pytest.fixture
def live_run(tmp_path):
    """A run directory with a checkpoint, owned by a live process; yields (run, process)."""
    run = make_run(tmp_path / "outputs", "2026-01-31/14-02-11", ["a=1"])
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    yield run, proc
    proc.kill()
    proc.wait()


def test_a_live_run_keeps_its_directory(tmp_path, live_run):
    run, proc = live_run
    assert rundir.live_owner(run)["pid"] == proc.pid
    with pytest.raises(OutputError, match=f"still going \\(pid {proc.pid} on "):
        rundir.own(run)
    # trainer.resume=auto neither shares the directory nor silently starts the run over: it says who continues it.
    with pytest.raises(OutputError, match=f"a live process is continuing it \\(pid {proc.pid} on .*wait for it to end"):
        resolve_resume("auto", tmp_path / "outputs", None, ["a=1"])

    proc.send_signal(signal.SIGKILL)  # kill -9: no cleanup, yet the lock goes with the process
    proc.wait()
    assert rundir.live_owner(run) is None
    assert resolve_resume("auto", tmp_path / "outputs", None, ["a=1"]).run_dir == run.absolute()
    rundir.own(run)
    assert rundir.live_owner(run)["pid"] == os.getpid() and rundir.owned_elsewhere(run) is None
    rundir.release(run)


def test_take_over_cleans_up_after_a_killed_run(tmp_path):
    run = make_run(tmp_path, "run", ["a=1"])
    write_status(run, "running")
    stale = [run / "checkpoints" / ".step-00000008.pt.4242.deadbeef.tmp", run / ".status.json.tmp-4242", run / ".metrics.csv.tmp"]
    stale.append(run / "checkpoints" / "step-00000008-0123abcd-00000.shard")  # written before the write was killed
    for p in stale:
        p.write_bytes(b"half")
    notes = rundir.take_over(run)
    assert not any(p.exists() for p in stale) and ckpt.load_checkpoint(run / "checkpoints" / "step-00000004.pt")
    assert read_status(run)["state"] == "killed" and "process ended" in read_status(run)["reason"]
    assert len(notes) == 3 and "3 temporary file(s)" in notes[0] and "1 shard file(s)" in notes[1] and "marked killed" in notes[2]
    write_status(run, "completed")
    assert rundir.take_over(run) == [] and read_status(run)["state"] == "completed"


def test_where_a_run_goes(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    write_status(old, "interrupted")
    assert rundir.plan("hydra.run.dir", new, False, None) == rundir.Place("hydra.run.dir", new, "new")
    assert rundir.plan("hydra.run.dir", new, False, old) == rundir.Place("hydra.run.dir", old, "resume")  # continues in place
    assert rundir.plan("hydra.run.dir", new, True, old) == rundir.Place("hydra.run.dir", new, "given")  # the command line decides
    write_status(old, "completed", step=40)
    with pytest.raises(rundir.AlreadyCompleted, match=f"{old} already completed this run \\(step 40\\): nothing to do"):
        rundir.plan("hydra.run.dir", new, False, old)
    assert rundir.plan("hydra.run.dir", new, True, old).how == "given"  # another directory was asked for: train there


def test_runs_whose_process_is_gone_are_marked_killed_at_the_next_start(tmp_path, live_run):
    live, _ = live_run  # running, and its lock held by a live process
    write_status(live, "running")
    dead = tmp_path / "outputs" / "2026-01-31" / "14-05-00"  # killed before its first checkpoint
    rundir.own(dead)
    write_status(dead, "running", pid=999999)
    rundir.release(dead)
    done = tmp_path / "outputs" / "multirun" / "2026-01-31" / "14-06-00" / "0"
    rundir.own(done)
    write_status(done, "completed")
    rundir.release(done)
    said = rundir.mark_killed(tmp_path / "outputs")
    assert said == [f"{dead.absolute()}: status.json said running but its process is gone: marked killed"]
    assert read_status(dead)["state"] == "killed" and read_status(dead)["pid"] == 999999 and "killed" in read_status(dead)["reason"]
    assert read_status(live)["state"] == "running" and read_status(done)["state"] == "completed"

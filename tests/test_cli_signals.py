"""A signal outside a training step stops the run within seconds: during data preparation (before the
first step: nothing to checkpoint) and during a long evaluation (the checkpoint of the last step).
Ctrl-C while the program is still starting is one line and exit 130. Real processes: signals and exit codes."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from test_cli_helpers import TEST_ENV, TINY, error_lines

# The slow part is made slow by patching it to wait (a marker file says it has begun).
SLOW = """
import pathlib, sys, time
where, marker = sys.argv[1], pathlib.Path(sys.argv[2])
def slow(real):
    def wrapper(*args, **kwargs):
        marker.write_text("begun")
        time.sleep(600)
        return real(*args, **kwargs)
    return wrapper
if where == "data":
    from rptrain.train import setup
    setup.build_data = slow(setup.build_data)
else:
    from rptrain.train import loop
    loop.Trainer._evaluate = slow(loop.Trainer._evaluate)
from rptrain.cli.main import command
command(sys.argv[3:])
"""


def _stop_while_slow(tmp_path, where, args, signum):
    run, marker = tmp_path / "run", tmp_path / "begun"
    proc = subprocess.Popen([sys.executable, "-c", SLOW, where, str(marker), *TINY, *args, f"hydra.run.dir={run}"], cwd=tmp_path,
                            env=TEST_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert marker.exists(), proc.communicate()
        sent = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    return run, proc.returncode, err, took


@pytest.mark.slow
def test_sigterm_during_data_preparation_stops_within_seconds(tmp_path):
    run, code, err, took = _stop_while_slow(tmp_path, "data", ["trainer.max_steps=4"], signal.SIGTERM)
    assert code == 143 and took < 10 and "Traceback" not in err, (code, took, err)
    [line] = [line for line in error_lines(err) if line.startswith("rptrain: stopped:")]
    assert "interrupted at step 0 (SIGTERM): no checkpoint to write yet" in line, err
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and status["signal"] == "SIGTERM" and not (run / "checkpoints").exists()


@pytest.mark.slow
def test_sigint_during_a_long_evaluation_checkpoints_the_last_step(tmp_path):
    args = ["trainer.max_steps=8", "trainer.eval_interval=2", "trainer.checkpoint_interval=100"]
    run, code, err, took = _stop_while_slow(tmp_path, "eval", args, signal.SIGINT)
    assert code == 130 and took < 10 and "Traceback" not in err, (code, took, err)
    assert (run / "checkpoints" / "step-00000002.pt").is_file(), err
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and status["step"] == 2 and status["checkpoint"].endswith("last.pt")
    # The stop spends its seconds on the checkpoint, not on drawing curves.png (matplotlib: 3 s under load).
    assert (run / "metrics.csv").is_file() and not (run / "curves.png").exists()


def test_the_rptrain_command_exits_without_collecting_torchs_garbage():
    """The console script's exit froze instead of collecting (3 of 3.4 s on the loaded dev machine): a
    stopped run ends within seconds. main() itself, which programs call in-process, freezes nothing."""
    code = ("import gc; from rptrain.cli import main as m; m.main = lambda argv=None: None; "
            "before = gc.get_freeze_count(); m.command([]); print(before == 0 and gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=TEST_ENV)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.3, 1.0])
def test_ctrl_c_while_starting_is_one_line_and_130(tmp_path, after_s):
    proc = subprocess.Popen([sys.executable, "-m", "rptrain.cli.main", *TINY, "trainer.max_steps=1"], cwd=tmp_path, env=TEST_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)  # importing torch and Hydra, composing the config
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and len(error_lines(err)) == 1, (proc.returncode, err)


def test_ctrl_c_just_after_the_run_directory_is_made_leaves_no_running_status(tmp_path):
    """A Ctrl-C between status.json's `running` and the job's signal handlers exited at once (the starting
    program's quiet handler) and left `running` behind (issue 31's campaign): `running` is written under them now."""
    code = ("import os, signal, time, sys\n"
            "from rptrain.cli import job\n"
            "real = job.config_tree\n"
            "def tree(*a, **k):\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "    return real(*a, **k)\n"
            "job.config_tree = tree\n"
            "from rptrain.cli.main import command\n"
            "command(sys.argv[1:])\n")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", code, *TINY, "trainer.max_steps=1", f"hydra.run.dir={run}"], cwd=tmp_path,
                          env=TEST_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    state = json.loads((run / "status.json").read_text())["state"] if (run / "status.json").exists() else None
    assert state != "running", state

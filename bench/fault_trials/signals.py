"""SIGTERM or SIGINT at a random moment (from the interpreter's start to the run's end), during a slow
data preparation (before the first step) and during a slow evaluation. Each must end within 10 s with
130 (SIGINT) or 143 (SIGTERM) or 0 (it finished first), no traceback, and a status.json that says how it
ended; a run stopped with a checkpoint then resumes bit-identical to the straight run."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import outcome as o
from .kills import broken_checkpoints, resumed_ok
from .proc import ENV, at_random_moment, finish, start, status
from .reference import ARGS, STEPS

LIMIT_S = 10.0  # the bound from the signal to the exit
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
SLOW_ENTRY = Path(__file__).with_name("slow_entry.py")


def signal_trial(index: int, work: Path, reference: Callable[[], dict], rng: random.Random, where: str) -> o.Trial:
    """``where``: random (proc.at_random_moment), data or eval (while that part waits);
    ``reference``: the straight run's final state, made when first needed."""
    signum = rng.choice([signal.SIGTERM, signal.SIGINT])
    cwd = work / f"signal-{index}"
    cwd.mkdir()
    run_dir = cwd / "run"
    extra = [f"hydra.run.dir={run_dir}"]
    marker = cwd / "begun"
    if where == "random":
        proc = start([*ARGS, *extra], cwd)
        delay = at_random_moment(proc, run_dir, STEPS, rng)
    else:
        proc = subprocess.Popen([sys.executable, str(SLOW_ENTRY), where, str(marker), *ARGS, *extra], cwd=cwd, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        while not marker.exists() and proc.poll() is None and time.monotonic() - started < 300:
            time.sleep(0.02)
        delay = time.monotonic() - started
    sent = time.monotonic()
    proc.send_signal(signum)
    code, out, err = finish(proc, LIMIT_S)
    took = time.monotonic() - sent
    state = status(run_dir)
    detail = {"signal": signum.name, "moment": delay if isinstance(delay, str) else f"{delay:.2f} s after the start", "exit": code, "exit_s": round(took, 2), "state": state.get("state")}
    case = f"{where}_{signum.name}"
    if code is None:
        detail["stderr"] = err[-1200:]
        return o.Trial("signal", case, o.HANG, detail)
    if "Traceback (most recent call last)" in err:
        detail["stderr"] = err[-800:]
        return o.Trial("signal", case, o.TRACEBACK, detail)
    if code == -signum and not state:  # before the job set its handlers (no status yet): the default action, as for any program
        return o.Trial("signal", case, "stopped_before_start", detail)
    if code == -signum and state.get("state") == "completed":  # after the run, as the interpreter exits
        return o.Trial("signal", case, "completed", detail)
    expected_state = {0: "completed", CODES[signum]: "interrupted"}
    if code not in expected_state or (run_dir.exists() and state.get("state") != expected_state[code]) or \
            (code == 0 and where != "random"):
        detail["stderr"] = err[-400:]
        return o.Trial("signal", case, o.BAD_END, detail)
    bad = broken_checkpoints(run_dir) if run_dir.exists() else []
    if bad:
        detail["broken"] = bad
        return o.Trial("signal", case, o.LOST, detail)
    if code == 0 or not (run_dir / "checkpoints" / "last.pt").exists():
        return o.Trial("signal", case, "stopped" if code else "completed", detail)
    return resumed_ok("signal", case, run_dir, cwd, reference(), extra, detail)

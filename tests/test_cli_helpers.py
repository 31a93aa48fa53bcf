"""Shared helpers for the CLI tests (no tests here): tiny configs and a subprocess runner.

A run is a real `python -m rptrain.cli.main` process (`rptrain`), or the same entry point called in
the test's process (`rptrain_here`) where the test needs no process of its own (signals, exit codes
of the interpreter, launchers, the environment): on a config that trains in about a second on a CPU
most of a fresh process's time is importing torch (and torch._dynamo, which the first optimizer
imports), Hydra and matplotlib, about 5 s of CPU a run that the test process pays once. The tests
also pack several checks into each run and use -m sweeps to get several runs from one call.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch

# A ResNet-18 with 8..64 channels on 64 synthetic 32x32 images of 10 classes: 4 steps per epoch.
TINY = [
    "model=resnet18",
    "model.widths=[8,16,32,64]",
    "model.stem_channels=8",
    "data=synthetic",
    "data.num_train=64",
    "data.num_test=32",
    "data.num_classes=10",
    "trainer.batch_size=16",
    "trainer.log_interval=1",
    "precision=fp32",
]


ROOT = Path(__file__).resolve().parents[1]
# One intra-op thread per run: the models are tiny, and on a shared 2-core machine several
# OpenMP threads per process spin against each other (runs became 30x slower under load).
TEST_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
# The recipes call $RPTRAIN; the console script may not be on PATH where the tests run.
RECIPE_ENV = {"RPTRAIN": f"{sys.executable} -m rptrain.cli.main", "MODEL": "resnet18", "DATA": "synthetic"}


def without_groups(overrides: list[str]) -> list[str]:
    """TINY minus its model=/data= choices, which the recipes make themselves."""
    return [o for o in overrides if not o.startswith(("model=", "data="))]


def rptrain(args: list[str], cwd: Path, timeout: float = 180, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    full_env = {**TEST_ENV, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rptrain.cli.main", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env,
    )


def rptrain_here(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`rptrain ARGS` run in this process from `cwd`: its exit code, stdout and stderr as a finished process's."""
    from rptrain.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for a process (TEST_ENV)
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as caught:
        _python_warning_filters()  # what a fresh interpreter shows (pytest's own filters would hide them)
        patch.chdir(cwd)
        patch.setattr(sys, "argv", list(sys.argv))  # main() sets it for Hydra
        try:
            main(list(args))
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        finally:
            torch.set_num_threads(threads)
    for w in caught:  # on stderr, where a process prints them
        err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _python_warning_filters() -> None:
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def train_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"

"""Running rptrain as the user does: a process of its own, a tiny config, a hard time limit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# One intra-op thread a run: the models are tiny and the machine is shared (as the tests do).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
# A ResNet-18 with 8..64 channels on 64 synthetic 32x32 images: 4 steps an epoch, about a second a step here.
TINY = ["model=resnet18", "model.widths=[8,16,32,64]", "model.stem_channels=8", "data=synthetic", "data.num_train=64",
        "data.num_test=32", "data.num_classes=10", "trainer.batch_size=16", "trainer.log_interval=1", "precision=fp32"]
# A llama_tiny on synthetic tokens: what rptrain-export, rptrain-generate and model.weights read.
LM = ["model=llama_tiny", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1", "model.vocab_size=32",
      "data=synthetic_tokens", "data.vocab_size=32", "data.num_train=16", "data.num_val=8", "data.seq_len=16",
      "trainer.batch_size=4", "precision=fp32", "trainer.hf_export=false"]


def command(args: list[str], entry: str = "rptrain.cli.main") -> list[str]:
    return [sys.executable, "-m", entry, *args]


def start(args: list[str], cwd: Path, entry: str = "rptrain.cli.main", env: Optional[dict] = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command(args, entry), cwd=cwd, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[Optional[int], str, str]:
    """(exit code or None if it outlived ``timeout`` and was killed, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err


def run(args: list[str], cwd: Path, timeout: float = 300, entry: str = "rptrain.cli.main", **kwargs) -> tuple[Optional[int], str, str]:
    return finish(start(args, cwd, entry, **kwargs), timeout)


def wait_for(path_glob: str, root: Path, proc: subprocess.Popen, timeout: float = 300) -> Optional[Path]:
    """The first file matching ``path_glob`` under ``root`` once it exists (None: the process ended or time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(root.glob(path_glob))
        if found:
            return found[0]
        if proc.poll() is not None:
            return None
        time.sleep(0.02)
    return None


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def steps_logged(run_dir: Path) -> int:
    """How many training steps metrics.jsonl records (0 before the first)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if '"kind": "train"' in line)


def at_random_moment(proc: subprocess.Popen, run_dir: Path, steps: int, rng) -> str:
    """Wait for a random moment of a run: while the program starts (1 in 5), else just after a random step
    has been logged, plus up to a second (steps, checkpoint writes and rotations, evaluations, the end).
    A moment measured by progress, not by the clock: on a loaded machine a run's pace varies several-fold."""
    if rng.random() < 0.2:
        time.sleep(rng.uniform(0, 5))
        return "starting"
    target = rng.randint(0, steps)
    deadline = time.monotonic() + 300
    while steps_logged(run_dir) < target and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 1.0))
    return f"after step {target}"

"""The uninterrupted run every interrupted one must reproduce bit for bit, and the comparison."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from rptrain.train.checkpoint import load_checkpoint

from .proc import TINY, run

STEPS = 8
COMPARED = ("model", "optimizer", "scheduler", "scaler")
# Checkpoints every 2 steps, two kept: kills land in writes, rotations and between them. Synchronous steps: a
# signal's checkpoint at an odd step (the straight run has none) would otherwise change, by design, which
# weights the next step's gradient sees (asynchronous steps: docs/engine.md), and no run could match.
ARGS = [*TINY, f"trainer.max_steps={STEPS}", "trainer.checkpoint_interval=2", "trainer.eval_interval=4", "trainer.async_step=false"]


def final_state(run_dir: Path) -> Optional[dict]:
    path = run_dir / "checkpoints" / "last.pt"
    return load_checkpoint(path) if path.exists() else None


def make_reference(work: Path) -> dict:
    """The straight run's final checkpoint."""
    code, out, err = run([*ARGS, f"hydra.run.dir={work / 'reference'}"], work)
    if code != 0:
        raise RuntimeError(f"the reference run failed: {err[-2000:]}")
    return final_state(work / "reference")


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two checkpoint states differ in the weights, optimizer, scaler, schedule or step (not clocks or metrics)."""
    if not where:  # the state a run continues from; the progress record also holds clocks and metrics
        # Python's own generator is saved but neither seeded nor used by training: only torch's must match.
        return differences({k: a.get(k) for k in COMPARED}, {k: b.get(k) for k in COMPARED}, "checkpoint") + \
            differences(a["rng"]["torch"], b["rng"]["torch"], "checkpoint.rng.torch") + \
            differences(a["progress"]["step"], b["progress"]["step"], "checkpoint.progress.step")
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} in one only"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"[:200]]

"""A finished run's directory reused (``hydra.run.dir`` again) with other overrides, or for the same run
from scratch: refused with one line and the folder untouched (checkpoints, metrics.jsonl, .hydra/, a
user's own ``*.tmp`` files); ``trainer.resume=auto`` on it says it is complete."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

from . import outcome as o
from .proc import run
from .reference import ARGS

OTHER = ["optim.optimizer.lr=0.01", "trainer.seed=7", "trainer.batch_size=8", "trainer.max_steps=6", "model.stem_channels=16"]


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "rptrain.log"}


def rundir_trial(index: int, work: Path, rng: random.Random) -> o.Trial:
    cwd = work / f"rundir-{index}"
    run_dir = cwd / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.tmp").write_text("the user's")
    args = [*ARGS, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    code, out, err = run(args, cwd)
    if code != 0:
        return o.Trial("rundir", "first_run", o.classify_exit(code or 0, err) if code is not None else o.HANG, {"stderr": err[-400:]})
    before = snapshot(run_dir)
    case = rng.choice(["other_overrides", "same_run_again", "resume_completed"])
    extra = {"other_overrides": [rng.choice(OTHER)], "same_run_again": [], "resume_completed": ["trainer.resume=auto"]}[case]
    code, out, err = run([*args, *extra], cwd)
    detail = {"extra": extra, "exit": code}
    if code is None:
        return o.Trial("rundir", case, o.HANG, detail)
    result = o.classify_exit(code, err)
    if result in o.FAILURES:
        detail["stderr"] = err[-400:]
        return o.Trial("rundir", case, result, detail)
    if snapshot(run_dir) != before:
        changed = sorted(k for k in set(before) | set(snapshot(run_dir)) if before.get(k) != snapshot(run_dir).get(k))
        detail["changed"] = changed[:8]
        return o.Trial("rundir", case, o.LOST, detail)
    expected = "completed" if case == "resume_completed" else "refused"
    return o.Trial("rundir", case, result if result == expected else o.BAD_END, detail)

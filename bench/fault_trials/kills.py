"""kill -9 at a random moment of a run (startup, steps, checkpoint writes and rotations, evaluation),
then every checkpoint left must verify and ``trainer.resume=auto`` must finish bit-identical to the
straight run. Two resumers of one killed run at once: one continues, the other waits or says why,
and nothing trains from scratch."""
from __future__ import annotations

import random
import time
from pathlib import Path

from rptrain.train.checkpoint import load_checkpoint
from rptrain.train.errors import CheckpointError

from . import outcome as o
from .proc import at_random_moment, finish, run, start, status, wait_for
from .reference import ARGS, STEPS, differences, final_state


def broken_checkpoints(run_dir: Path) -> list[str]:
    bad = []
    for path in sorted((run_dir / "checkpoints").glob("*.pt")):
        try:
            load_checkpoint(path)
        except (CheckpointError, OSError, RuntimeError, ValueError) as e:
            bad.append(f"{path.name}: {e}"[:300])
    return bad


def resumed_ok(kind: str, case: str, run_dir: Path, cwd: Path, reference: dict, extra: list[str], detail: dict) -> o.Trial:
    """Resume in place to the end; the final state must equal the straight run's."""
    code, out, err = run([*ARGS, *extra, "trainer.resume=auto"], cwd)
    detail["resume_exit"] = code
    if code is None:
        return o.Trial(kind, case, o.HANG, detail)
    if code != 0:
        detail["stderr"] = err[-600:]
        return o.Trial(kind, case, o.TRACEBACK if "Traceback" in err else o.LOST, detail)
    state = final_state(run_dir)
    diff = differences(reference, state) if state is not None else ["no final checkpoint"]
    if diff:
        detail["differences"] = diff[:5]
        return o.Trial(kind, case, o.LOST, detail)
    return o.Trial(kind, case, "resumed_identical", detail)


def kill9(index: int, work: Path, reference: dict, rng: random.Random) -> o.Trial:
    cwd = work / f"kill9-{index}"
    cwd.mkdir()
    run_dir = cwd / "run"
    extra = [f"hydra.run.dir={run_dir}"]
    proc = start([*ARGS, *extra], cwd)
    moment = at_random_moment(proc, run_dir, STEPS, rng)
    finished = proc.poll() is not None
    proc.kill()
    finish(proc, 30)
    detail = {"moment": moment, "finished_first": finished, "state_left": status(run_dir).get("state"),
              "checkpoints_left": sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt")) if run_dir.exists() else []}
    bad = broken_checkpoints(run_dir) if run_dir.exists() else []
    if bad:
        detail["broken"] = bad
        return o.Trial("kill9", "random_moment", o.LOST, detail)
    return resumed_ok("kill9", "random_moment", run_dir, cwd, reference, extra, detail)


def concurrent_resumers(index: int, work: Path, reference: dict, rng: random.Random) -> o.Trial:
    """Killed after its first checkpoint, then two ``resume=auto`` at once in the same output root."""
    cwd = work / f"resumers-{index}"
    cwd.mkdir()
    first = start(ARGS, cwd)
    wait_for("outputs/*/*/checkpoints/step-00000002.pt", cwd, first)
    first.kill()
    finish(first, 30)
    runs_before = sorted(cwd.glob("outputs/*/*/.hydra"))
    a = start([*ARGS, "trainer.resume=auto"], cwd)
    time.sleep(rng.uniform(0, 3))
    b = start([*ARGS, "trainer.resume=auto"], cwd)
    (ca, oa, ea), (cb, ob, eb) = finish(a, 300), finish(b, 300)
    detail = {"exits": [ca, cb], "delay_between": None, "runs": len(sorted(cwd.glob("outputs/*/*/.hydra")))}
    if None in (ca, cb):
        return o.Trial("resumers", "two_at_once", o.HANG, detail)
    if "Traceback" in ea + eb:
        detail["stderr"] = (ea + eb)[-600:]
        return o.Trial("resumers", "two_at_once", o.TRACEBACK, detail)
    if len(runs_before) != 1 or detail["runs"] != 1:
        return o.Trial("resumers", "two_at_once", o.LOST, detail)  # one of them started a fresh run
    refused = [e for c, e in ((ca, ea), (cb, eb)) if c != 0]
    if 0 not in (ca, cb) or any(len([line for line in e.splitlines() if line.strip()]) != 1 for e in refused):
        detail["stderr"] = (ea + eb)[-600:]
        return o.Trial("resumers", "two_at_once", o.BAD_END, detail)
    state = final_state(runs_before[0].parent)
    diff = differences(reference, state) if state is not None else ["no final checkpoint"]
    if diff:
        detail["differences"] = diff[:5]
        return o.Trial("resumers", "two_at_once", o.LOST, detail)
    return o.Trial("resumers", "two_at_once", "one_resumed" if refused else "both_finished", detail)

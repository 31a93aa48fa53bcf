"""torchrun with two ranks (gloo on the CPU): one rank killed with kill -9 or frozen with SIGSTOP (never
continued) at a random moment. The launch must end within its bound (a freeze: dist.timeout_s plus
torchrun's grace before it kills), with no traceback from rptrain, no checkpoint broken, a status.json that
does not stay ``running`` unless rank 0 itself was struck, and ``trainer.resume=auto`` on two ranks must
finish bit-identical to the straight two-rank run."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from . import outcome as o
from .kills import broken_checkpoints
from .proc import ENV, ROOT, status, steps_logged
from .reference import differences, final_state

STEPS = 8
TIMEOUT_S = 5  # dist.timeout_s: how long a live rank waits for a frozen one
# torchrun, once a rank has failed, sends SIGTERM to the others and SIGKILL 30 s later (a frozen rank cannot
# act on SIGTERM): the bound for a freeze is the collective's timeout, that grace and a margin for a loaded machine.
LIMIT_S = {"kill9": 60.0, "freeze": TIMEOUT_S + 30.0 + 30.0}
# A tiny Llama on synthetic tokens: no BatchNorm, no augmentation. Synchronous steps and checkpoints every two
# steps, as the single-process kill trials (reference.py says why).
ARGS = ["model=llama_tiny", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1", "model.vocab_size=32",
        "data=synthetic_tokens", "data.vocab_size=32", "data.num_train=32", "data.num_val=8", "data.seq_len=16",
        "trainer.batch_size=4", "precision=fp32", "trainer.hf_export=false", "run_config.num_microbatch=1",
        "trainer.log_interval=1", "trainer.progress=false", f"trainer.max_steps={STEPS}", "trainer.checkpoint_interval=2",
        "trainer.eval_interval=4", "trainer.async_step=false", f"dist.timeout_s={TIMEOUT_S}"]
CASES = [(fault, rank) for fault in ("kill9", "freeze") for rank in (0, 1)]  # trial i takes CASES[i % 4]
OUR_FRAME = re.compile(r'File "' + re.escape(str(ROOT / "rptrain")))


def torchrun(args: list[str], cwd: Path) -> subprocess.Popen:
    scratch = cwd / "scratch"  # the other rank's Hydra directory lives under TMPDIR
    scratch.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "rptrain.cli.main", *args]
    return subprocess.Popen(cmd, cwd=cwd, env={**ENV, "TMPDIR": str(scratch)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def ranks_of(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes (their RANK environment variable)."""
    found = {}
    for task in Path(f"/proc/{launcher.pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = [e[5:] for e in environ if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0])] = pid
    return found


def our_tracebacks(stderr: str) -> list[str]:
    """Tracebacks with a frame in rptrain. torchrun prints its own (ChildFailedError) when a rank fails: that
    one is the launcher reporting, as it does for any program."""
    blocks = stderr.split("Traceback (most recent call last)")[1:]
    return [b[:600] for b in blocks if OUR_FRAME.search(b)]


def end_all(launcher: subprocess.Popen, ranks: dict[int, int]) -> None:
    """Nothing outlives a trial: torchrun starts each rank in a session of its own, and a frozen rank cannot
    leave by itself (it would also hold the launcher's output pipes open)."""
    launcher.kill()
    for pid in ranks.values():
        try:
            if b"rptrain.cli.main" in Path(f"/proc/{pid}/cmdline").read_bytes():  # still that rank, not a reused pid
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def finish_launch(launcher: subprocess.Popen, ranks: dict[int, int], timeout: float) -> tuple[Optional[int], str, str]:
    """(torchrun's exit code, or None if it outlived ``timeout``; stdout; stderr). Every rank is killed after."""
    try:
        out, err = launcher.communicate(timeout=timeout)
        code = launcher.returncode
    except subprocess.TimeoutExpired:
        code = None
        ranks = {**ranks_of(launcher), **ranks}  # the launcher still runs: its ranks are its children
    end_all(launcher, ranks)
    if code is None:
        out, err = launcher.communicate(timeout=30)
    return code, out, err


def launch_and_strike(run_dir: Path, cwd: Path, fault: str, rank: int, rng: random.Random) -> tuple[subprocess.Popen, dict[int, int], dict]:
    """Start two ranks and strike ``rank`` with ``fault`` at a random moment: while they start (1 in 5) or just after a random
    step was logged, plus up to a second (steps, checkpoint writes, evaluations, the end)."""
    launcher = torchrun([*ARGS, f"hydra.run.dir={run_dir}"], cwd)
    deadline = time.monotonic() + 300
    if rng.random() < 0.2:
        moment = "starting"
        while len(ranks_of(launcher)) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 4))
    else:
        target = rng.randint(0, STEPS)
        moment = f"after step {target}"
        while steps_logged(run_dir) < target and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 1.0))
    ranks = ranks_of(launcher)
    pid = ranks.get(rank)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL if fault == "kill9" else signal.SIGSTOP)
        except ProcessLookupError:
            pid = None
    return launcher, ranks, {"fault": fault, "rank": rank, "moment": moment, "struck": pid is not None}


def rank_trial(index: int, work: Path, reference: Callable[[], dict], rng: random.Random) -> o.Trial:
    """``reference``: the straight two-rank run's final state, made when first needed."""
    cwd = work / f"ranks-{index}"
    cwd.mkdir()
    run_dir = cwd / "run"
    launcher, ranks, detail = launch_and_strike(run_dir, cwd, *CASES[index % len(CASES)], rng)
    case = f"{detail['fault']}_rank{detail['rank']}"
    struck = time.monotonic()
    code, out, err = finish_launch(launcher, ranks, LIMIT_S[detail["fault"]])
    detail.update(exit=code, exit_s=round(time.monotonic() - struck, 1), state=status(run_dir).get("state"))
    if code is None and detail["state"] == "completed" and detail["fault"] == "freeze":
        # Frozen after its last collective, as it exits: no peer waits for it any more, so nothing in rptrain can
        # see it; torchrun waits for it as for any program. The run's work is all saved: checked below.
        detail["launcher"] = "waited on the frozen rank after the run completed"
    elif code is None:
        detail["stderr"] = err[-1200:]
        return o.Trial("ranks", case, o.HANG, detail)
    ours = our_tracebacks(err)
    if ours:
        detail["traceback"] = ours[0]
        return o.Trial("ranks", case, o.TRACEBACK, detail)
    rank0_struck = detail["struck"] and detail["rank"] == 0
    if run_dir.exists() and detail["state"] == "running" and not rank0_struck:
        detail["stderr"] = err[-600:]
        return o.Trial("ranks", case, o.BAD_END, detail)
    bad = broken_checkpoints(run_dir) if run_dir.exists() else []
    if bad:
        detail["broken"] = bad
        return o.Trial("ranks", case, o.LOST, detail)
    trial = resumed_on_two_ranks(case, run_dir, cwd, reference(), detail)
    if "launcher" in detail and trial.outcome == "resumed_identical":
        trial.outcome = "completed_then_frozen"  # not a failure: the work was saved whole; torchrun waited on the rank
    return trial


def resumed_on_two_ranks(case: str, run_dir: Path, cwd: Path, reference: dict, detail: dict) -> o.Trial:
    resumer = torchrun([*ARGS, f"hydra.run.dir={run_dir}", "trainer.resume=auto"], cwd)
    code, out, err = finish_launch(resumer, {}, 300)
    detail["resume_exit"] = code
    if code is None:
        return o.Trial("ranks", case, o.HANG, detail)
    if code != 0:
        detail["stderr"] = err[-800:]
        return o.Trial("ranks", case, o.TRACEBACK if our_tracebacks(err) else o.LOST, detail)
    state = final_state(run_dir)
    diff = differences(reference, state) if state is not None else ["no final checkpoint"]
    if diff:
        detail["differences"] = diff[:5]
        return o.Trial("ranks", case, o.LOST, detail)
    return o.Trial("ranks", case, "resumed_identical", detail)


def make_reference(work: Path) -> Optional[dict]:
    """The straight two-rank run's final checkpoint."""
    launcher = torchrun([*ARGS, f"hydra.run.dir={work / 'reference'}"], work)
    code, out, err = finish_launch(launcher, {}, 300)
    if code != 0:
        raise RuntimeError(f"the two-rank reference run failed: {err[-2000:]}")
    return final_state(work / "reference")

"""One Hydra job: print the config, train, and leave the run directory in a clear final state.

status.json says running / completed / failed / interrupted; summary.json appears only when
the run completed. User errors end the process with one line on stderr and exit code 2;
SIGTERM/SIGINT end it after a checkpoint with 128 + the signal number.

Under torchrun only rank 0 writes the run directory and talks; every rank prints its own fatal
error as one line starting with its rank, and a failed collective (a peer died or hung) ends
the run with exit code 1.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from rptrain.train import auto_precision, checkpoint, dist, rundir
from rptrain.train.console import config_tree, make_console, say
from rptrain.train.errors import USER_ERRORS, one_line
from rptrain.train.loggers import Loggers
from rptrain.train.loop import Trainer
from rptrain.train.shown_config import shown_config
from rptrain.train.signals import Interrupted, StopNow, stop_on_signals
from rptrain.train.status import read_status, write_json_atomic, write_status

log = logging.getLogger("rptrain")


def fail(message: str, code: int = 2, to_log: bool = True, kind: str = "error") -> NoReturn:
    message = dist.rank_prefix() + message  # under torchrun the ranks' output interleaves
    if to_log:  # inside a job: the run's log file (before one, logging would echo it to stderr)
        log.error(message)
    dist.say(f"rptrain: {kind}: {message}")
    raise SystemExit(code)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the same arguments with trainer.resume=auto."""
    kept = [a for a in argv if a.lstrip("+").split("=", 1)[0] != "trainer.resume" and a not in rundir.CLAIMED]
    if dist.world_size() > 1:  # torchrun's own arguments are not ours to know; any world size dividing the batch fits
        return shlex.join(["torchrun", "...", "-m", "rptrain.cli.main", *kept, "trainer.resume=auto"])
    return shlex.join(["rptrain", *kept, "trainer.resume=auto"])


def run_job(cfg: DictConfig) -> dict:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    main = dist.rank() == 0
    if main:
        try:
            rundir.own(run_dir)  # a sweep's job directory; a single run's main() owns it already
        except USER_ERRORS as err:
            fail(one_line(err))
    try:
        return _run(cfg, run_dir, main)
    finally:
        rundir.release(run_dir)  # the next job of a sweep may resume it


def _run(cfg: DictConfig, run_dir: Path, main: bool) -> dict:
    hydra_cfg = HydraConfig.get()
    overrides = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)  # as typed: ${oc.env:KEY} stays unresolved
    console = make_console() if main else Console(quiet=True)  # the other ranks keep quiet

    def status(state: str, **details: object) -> None:  # rank 0's run directory only
        if main:
            try:
                write_status(run_dir, state, **details)
            except OSError:  # a full disk: the one-line error says more than a status would
                pass

    notes = [*rundir.take_over(run_dir), *rundir.mark_killed(Path(cfg.output_root))] if main else []
    console.print(config_tree(cfg, label=f"rptrain  {run_dir}"))
    for note in notes:
        say(console, note)
    log.info("config:\n%s", OmegaConf.to_yaml(shown_config(cfg)))  # the tree above, for rptrain.log
    if hydra_cfg.runtime.choices.get("precision") == "auto":
        say(console, auto_precision.describe())
    loggers = Loggers()  # rank 0's experiment trackers, opened below (a failure to open is the run's)
    hint = resume_command(sys.argv[1:])
    # Under torchrun the launcher forwards a signal to every rank, and SLURM may deliver it too.
    duplicate_s = 10.0 if dist.world_size() > 1 else 0.0
    group = dist.Dist()

    def stopped_now(signum: int) -> None:  # a second signal: no checkpoint, but the status says how it ended
        for tmp in list(checkpoint.in_flight):  # a write it cut short
            tmp.unlink(missing_ok=True)
        status("interrupted", signal=signal.Signals(signum).name, error="second signal: stopped at once without a checkpoint", resume=hint)

    try:
        # One process stops within seconds wherever it is; ranks stop together after a step (signals.py).
        with stop_on_signals(announce=main, duplicate_s=duplicate_s, on_abort=stopped_now, immediate=dist.world_size() == 1) as stop:
            # `running` only once a signal is ours to record: before, Ctrl-C exits at once (_startup.py) and left it `running`
            status("running", pid=os.getpid(), host=socket.gethostname(), started=time.strftime("%Y-%m-%d %H:%M:%S"))
            group = dist.setup(cfg.dist)
            loggers = Loggers(cfg, run_dir) if main else loggers
            summary = Trainer(cfg, run_dir, overrides, console, hint, group, loggers.log).fit(stop)
            loggers.finish(summary, "completed")
    except (Interrupted, StopNow) as stopped:
        if isinstance(stopped, StopNow):  # before training started (setup, data preparation) or after it ended
            stopped = Interrupted(stopped.request, 0, "")
        status("interrupted", step=stopped.step, signal=stopped.request.name, checkpoint=stopped.checkpoint or None, resume=hint)
        if main:
            saved = f"checkpoint saved to {stopped.checkpoint}" if stopped.checkpoint else "no checkpoint to write yet"
            say_stopped = f"interrupted at step {stopped.step} ({stopped.request.name}): {saved}; resume with: {hint}"
            log.error(say_stopped)
            dist.say(f"rptrain: stopped: {say_stopped}")
        _wait_for_rank0(group)  # nobody leaves before rank 0 has written and said it: torchrun would kill it
        raise SystemExit(stopped.request.exit_code)
    except dist.FailedOnRankZero:
        raise SystemExit(2)
    except dist.NothingToDo:  # rank 0 said so (trainer.resume=auto on a completed run); the other ranks keep quiet
        raise SystemExit(0)
    except dist.PeerError as err:
        status("failed", error=one_line(err))
        fail(one_line(err), code=1)
    except USER_ERRORS as err:
        status("failed", error=one_line(err))
        fail(one_line(err))
    except KeyboardInterrupt:
        status("interrupted", error="second signal: stopped without a checkpoint")
        raise SystemExit(130)
    except OSError as err:  # writing the run directory failed (disk full, permissions)
        where = err.filename or run_dir
        status("failed", error=one_line(f"{where}: {err.strerror or err}"))
        fail(f"cannot write {where}: {err.strerror or one_line(err)}: free some space or make it writable, or set output_root elsewhere")
    except BaseException as err:
        status("failed", error=one_line(repr(err)))
        if dist.world_size() > 1 and not isinstance(err, SystemExit):  # one line before the traceback, naming the rank
            dist.say(f"rptrain: error: rank {dist.rank()}: {one_line(repr(err))[:300]}")
        if isinstance(err, Exception) and dist.world_size() == 1 and not _in_sweep() and os.environ.get("HYDRA_FULL_ERROR") != "1":
            # A bug, not a user error: the traceback goes to rptrain.log, and the error itself is the one
            # line the user sees, not whatever note or cleanup message Hydra's trimmed traceback ends with.
            log.exception("the run failed")
            fail(f"{type(err).__name__}: {one_line(err)} (unexpected: the traceback is in {run_dir / 'rptrain.log'})", code=1, to_log=False)
        raise
    finally:  # a run that did not complete: the trackers close with the state status.json holds
        loggers.finish(None, read_status(run_dir).get("state", "failed"))
    if not main:
        return summary
    try:
        write_json_atomic(run_dir / "summary.json", summary)
    except OSError as err:  # a full disk at the very end: the trained weights are in the checkpoint already
        where = err.filename or run_dir / "summary.json"
        status("failed", error=one_line(f"{where}: {err.strerror or err}"), step=summary["steps"])
        fail(f"cannot write {where}: {err.strerror or one_line(err)}: free some space (training completed: the weights are in "
             f"{summary.get('checkpoint')}; rerun with trainer.resume=auto to write the summary)")
    status("completed", step=summary["steps"])
    final = " | ".join(f"{k} {v:.4f}" for k, v in summary["final"].items())
    rate = f"{summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary else f"{summary['samples_per_s']:,.0f} samples/s"
    say(console, f"done: {summary['steps']} steps | {final} | {rate} | {run_dir}")
    return summary


def _in_sweep() -> bool:
    """A -m job: job_result.run_and_report turns its failure into the sweep's row and one line."""
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _wait_for_rank0(group: dist.Dist) -> None:
    try:
        group.barrier("the wait for rank 0's checkpoint")
    except dist.PeerError:
        pass  # a peer is gone already: leaving is all that is left to do

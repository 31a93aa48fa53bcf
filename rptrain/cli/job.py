"""One Hydra job: print the config, train, and leave the run directory in a clear final state.

status.json says running / completed / failed / interrupted; summary.json appears only when
the run completed. User errors end the process with one line on stderr and exit code 2;
SIGTERM/SIGINT end it after a checkpoint with 128 + the signal number.
"""
from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rptrain.train.console import config_tree, make_console, say
from rptrain.train.errors import USER_ERRORS, one_line
from rptrain.train.loop import Trainer
from rptrain.train.signals import Interrupted, stop_on_signals
from rptrain.train.status import write_json_atomic, write_status

log = logging.getLogger("rptrain")


def fail(message: str, code: int = 2, to_log: bool = True, kind: str = "error") -> NoReturn:
    if to_log:  # inside a job: the run's log file (before one, logging would echo it to stderr)
        log.error(message)
    print(f"rptrain: {kind}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the same arguments with trainer.resume=auto."""
    kept = [a for a in argv if a.lstrip("+").split("=", 1)[0] != "trainer.resume"]
    return shlex.join(["rptrain", *kept, "trainer.resume=auto"])


def run_job(cfg: DictConfig) -> dict:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    console = make_console()
    write_status(run_dir, "running")
    console.print(config_tree(cfg, label=f"rptrain  {run_dir}"))
    hint = resume_command(sys.argv[1:])
    try:
        with stop_on_signals() as stop:
            summary = Trainer(cfg, run_dir, overrides, console, hint).fit(stop)
    except Interrupted as stopped:
        write_status(run_dir, "interrupted", step=stopped.step, signal=stopped.request.name, checkpoint=stopped.checkpoint, resume=hint)
        fail(f"interrupted at step {stopped.step} ({stopped.request.name}): checkpoint saved to {stopped.checkpoint}; "
             f"resume with: {hint}", code=stopped.request.exit_code, kind="stopped")
    except USER_ERRORS as err:
        write_status(run_dir, "failed", error=one_line(err))
        fail(one_line(err))
    except KeyboardInterrupt:
        write_status(run_dir, "interrupted", error="second signal: stopped without a checkpoint")
        raise SystemExit(130)
    except BaseException as err:
        write_status(run_dir, "failed", error=one_line(repr(err)))
        raise
    write_json_atomic(run_dir / "summary.json", summary)
    write_status(run_dir, "completed", step=summary["steps"])
    final = " | ".join(f"{k} {v:.4f}" for k, v in summary["final"].items())
    rate = f"{summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary else f"{summary['samples_per_s']:,.0f} samples/s"
    say(console, f"done: {summary['steps']} steps | {final} | {rate} | {run_dir}")
    return summary

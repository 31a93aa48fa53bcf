"""`rptrain`: the Hydra entry point (console script rptrain = rptrain.cli.main:command, which calls main()).

    rptrain model=resnet34 data=cifar100            one run under outputs/DATE/TIME/
    rptrain -m run_config.num_microbatch=1,2,4      a sweep, every job in this process
    rptrain --cfg job                               the composed config, resolved
    rptrain --explain model=resnet18 ...            the engine's plan and actions for one batch, no training
    rptrain --preview data=chat data.path=...       the first conversations rendered, trained tokens marked

Every job is composed and checked first (preflight.py), so a bad command line costs one
line on stderr and exit code 2 instead of Hydra's multi-line report and a stray run directory.

Under torchrun the same command runs on every rank (train/dist.py). Ranks other than 0 keep
Hydra's run directory and log in a temporary folder that is removed when they exit.
"""
from __future__ import annotations

import gc
import shutil
import sys
import tempfile
from typing import Optional, Union

from rptrain._startup import quiet_interrupts

_restore_interrupts = quiet_interrupts()  # the imports below take a second or two: Ctrl-C there is one line, exit 130
import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from rptrain.train import dist, rundir
from rptrain.train.errors import USER_ERRORS
from rptrain.train.explain import explain_config
from rptrain.train.schema import register_configs

from . import hydra_writes
from .errors import describe
from .job import fail, run_job
from .job_result import JobFailed, run_and_report
from .preflight import CONFIG_NAME, CONFIG_PATH, compose_job, parse_args, preflight

register_configs()
hydra_writes.install()  # Hydra's own writes of a job's directory: one line, and a sweep goes on
_restore_interrupts()


@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
def _app(cfg: DictConfig) -> Union[float, JobFailed]:
    return run_and_report(run_job, cfg)  # trainer.objective for a sweeper; a failed sweep job lets the others run


def main(argv: Optional[list[str]] = None) -> None:
    restore = quiet_interrupts()  # until the job's own handlers (train/signals.py) take over
    try:
        _main(argv)
    finally:
        restore()


def _main(argv: Optional[list[str]]) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    explain, preview = "--explain" in argv, "--preview" in argv  # ours, not Hydra's: taken out before Hydra parses the rest
    argv = [a for a in argv if a not in ("--explain", "--preview")]
    try:
        rank = dist.rank()
        if explain or preview:
            from rptrain.train.preview import preview_config

            flag = "--preview" if preview else "--explain"
            print((preview_config if preview else explain_config)(compose_job(argv, flag)), flush=True)
            return
        place = preflight(argv)
        claimed = rundir.claim(place) if place is not None else None  # a directory of its own, before Hydra makes one
    except rundir.AlreadyCompleted as done:
        print(f"rptrain: {done}", flush=True)
        if done.dist is not None:
            dist.end_before_start(done.dist, str(done))
        raise SystemExit(0)
    except (*USER_ERRORS, HydraException, OmegaConfBaseException) as err:
        # Every rank says it, named (fail's rank prefix): a rank that exited silently made torchrun stop the others,
        # rank 0 among them, before rank 0 had printed, and the run ended with no line (tests/test_cli_dist.py).
        fail(describe(err), to_log=False)
    except OSError as err:  # the output directory could not be created
        fail(f"cannot create the run directory {err.filename or ''}: {err.strerror or err}: choose another output_root or hydra.run.dir", to_log=False)
    if claimed is not None:
        argv.append(claimed)
    args = parse_args(argv)
    if args.cfg == "job" and not args.resolve:
        argv.append("--resolve")  # show values (num_classes: 100), not ${data.num_classes}
    scratch = None
    if rank > 0 and args.cfg is None and not (args.help or args.hydra_help or args.info or args.shell_completion):
        scratch = tempfile.mkdtemp(prefix=f"rptrain-rank{rank}-")
        argv += [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null", "hydra/hydra_logging=disabled"]
    sys.argv = [sys.argv[0] or "rptrain", *argv]
    GlobalHydra.instance().clear()
    try:
        _app()
        dist.shutdown()  # only after a clean run: after a failed collective, leaving the group can hang
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def command(argv: Optional[list[str]] = None) -> None:
    """The `rptrain` command: main(), then an exit that does not collect the garbage of torch's modules.
    That collection took 3 s of a 3.4 s exit on the loaded 2-core dev machine (1 s with the objects frozen):
    a run stopped by a signal must end within seconds. Frozen, not skipped with os._exit: atexit handlers
    still run and files still close. Not in main(), which tests and programs call in their own process."""
    try:
        main(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    command()

"""What one job hands back to Hydra's sweeper: its objective, or a failure that does not stop the sweep.

A sweeper such as Optuna minimises (or maximises) the float a job returns: trainer.objective
names a key of the run's final metrics (default test_loss, the final evaluation loss). In a -m
sweep a job that fails returns a JobFailed instead of raising: Hydra's basic sweeper goes on with
the next job, and Optuna records a failed trial (it cannot take float() of it) and goes on too.
The sweep summary then marks the job failed with its one-line reason and the sweep exits 1
(train/sweep.py). A signal still stops the whole sweep, and so does any failure under torchrun,
where the other ranks could not go on without this one.
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Callable, Union

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rptrain.train import dist
from rptrain.train.errors import ConfigError, one_line
from rptrain.train.model import LM, model_kind
from rptrain.train.status import read_status, write_status

log = logging.getLogger("rptrain")

OBJECTIVES = ("test_loss", "test_acc", "test_ppl", "train_loss", "train_acc", "train_ppl")


class JobFailed:
    """A failed job's return value; float() of it raises, which is how Optuna learns the trial failed."""

    def __init__(self, job: str, reason: str) -> None:
        self.job, self.reason = job, reason

    def __repr__(self) -> str:
        return f"job {self.job} failed: {self.reason}"


def check_objective(cfg: DictConfig) -> None:
    metric = "ppl" if model_kind(cfg.model) == LM else "acc"
    allowed = [name for name in OBJECTIVES if name.endswith(("_loss", f"_{metric}"))]
    if cfg.trainer.objective not in allowed:
        raise ConfigError(f"trainer.objective={cfg.trainer.objective} is not a final metric of {cfg.model.name}: choose one of {', '.join(allowed)}")


def objective(summary: dict, name: str) -> float:
    """The run's value of trainer.objective; nan when the run has no such metric (no eval set, an LM's acc)."""
    value = summary.get("final", {}).get(name)
    return math.nan if value is None else float(value)


def run_and_report(run_job: Callable[[DictConfig], dict], cfg: DictConfig) -> Union[float, JobFailed]:
    """run_job(cfg)'s objective; in a one-process sweep a failure becomes a JobFailed."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or dist.world_size() > 1:
        return objective(run_job(cfg), cfg.trainer.objective)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    job = str(hydra_cfg.job.num)
    try:
        summary = run_job(cfg)
    except SystemExit as err:
        if not isinstance(err.code, int) or err.code >= 128:  # SIGINT/SIGTERM: stop the sweep, as in a single run
            raise
        return JobFailed(job, read_status(run_dir).get("error", f"exit code {err.code}"))  # its line is printed already
    except Exception as err:  # a bug, not a user error: the traceback goes to the job's log, one line to stderr
        log.exception(f"job {job} failed")
        reason = one_line(repr(err))[:300]
        if read_status(run_dir).get("state") != "failed":
            write_status(run_dir, "failed", error=reason)
        print(f"rptrain: error: job {job} failed: {reason} (traceback in {run_dir / 'rptrain.log'})", file=sys.stderr, flush=True)
        return JobFailed(job, reason)
    value = objective(summary, cfg.trainer.objective)
    if math.isnan(value):
        return JobFailed(job, f"trainer.objective={cfg.trainer.objective} is not among this run's final metrics {sorted(summary['final'])}")
    return value

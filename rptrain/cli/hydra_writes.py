"""Hydra's own writes for a job (its directory, .hydra/, before any rptrain code of the job runs) failing
(disk full, a file where the directory goes, no permission): one line instead of Hydra's traceback.

A single run ends there with exit code 2. In a -m sweep that job fails and the others still run: Hydra's
basic sweeper stops at the first job that raises, so the job hands back a JobFailed as a job that failed
in our code does (job_result.py), and the sweep summary lists it with its reason (train/sweep.py).
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Any

from hydra._internal import hydra as hydra_main
from hydra._internal.core_plugins import basic_launcher
from hydra.core import utils as hydra_utils
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from rptrain.train.errors import one_line
from rptrain.train.sweep import unwritable_jobs

from .job_result import JobFailed

_real_run_job = hydra_utils.run_job


def _message(err: OSError, where: Any) -> str:
    fix = ("a file is where the directory goes: move it" if err.errno in (errno.EEXIST, errno.ENOTDIR)
           else "free some space or make it writable")
    return f"cannot write {err.filename or where}: {err.strerror or one_line(err)}: {fix}, or choose another output_root"


def run_job(*args: Any, **kwargs: Any) -> JobReturn:
    try:
        return _real_run_job(*args, **kwargs)
    except OSError as err:
        config: DictConfig = kwargs["config"] if "config" in kwargs else args[1]
        subdir_key = kwargs["job_subdir_key"] if "job_subdir_key" in kwargs else args[3]
        where = OmegaConf.select(config, kwargs.get("job_dir_key", "hydra.run.dir"), default="the job directory")
        if subdir_key is None:  # one run: nothing else to do
            print(f"rptrain: error: {_message(err, where)}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        job = str(config.hydra.job.num)
        where = os.path.join(str(where), str(OmegaConf.select(config, subdir_key, default="")))
        line = _message(err, where)
        print(f"rptrain: error: job {job}: {line}", file=sys.stderr, flush=True)
        overrides = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
        unwritable_jobs.append({"job": job, "status": "failed", "error": line, "overrides": overrides, "run_dir": where})
        ret = JobReturn(overrides=overrides, cfg=config, hydra_cfg=config, working_dir=os.getcwd(), task_name=str(config.hydra.job.name))
        ret.status, ret.return_value = JobStatus.COMPLETED, JobFailed(job, line)  # COMPLETED: the basic sweeper goes on
        return ret


def install() -> None:
    """Route Hydra's run and basic launcher through run_job above (idempotent). hydra.core.utils too: Hydra's plugin
    scan executes the launcher's module again, which then imports run_job from there."""
    hydra_utils.run_job = run_job
    hydra_main.run_job = run_job
    basic_launcher.run_job = run_job

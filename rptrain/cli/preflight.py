"""Compose and check every job of a command line before Hydra starts.

Hydra reports a bad override with a multi-line message and exit code 1, after it may already
have created the run directory. Here each job's config (each combination of a -m sweep) is
composed with the same search path as the app, then checked: values (schema and
rptrain.train.validate), the dataset, the resume checkpoint (against the model built on the
meta device, so no memory is spent) and the output directory. Any problem raises with a
one-line message before a directory exists.

Under torchrun every rank checks the values; the files are checked once per machine (local rank
0, which also downloads a missing CIFAR) and the output directory and resume checkpoint by rank
0 alone, which writes the one and chooses the other for everyone.
"""
from __future__ import annotations

import argparse
import copy
import os
import re
from pathlib import Path
from typing import Optional

from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rptrain.train import dist
from rptrain.train.checkpoint import load_checkpoint
from rptrain.train.errors import ConfigError
from rptrain.train.loggers import check_loggers
from rptrain.train.model import LM, build_model, fingerprint, model_kind
from rptrain.train.precision import torch_dtype
from rptrain.train.resume import check_resume_state, resolve_resume
from rptrain.train.rundir import AlreadyCompleted, Place, check_belongs, plan
from rptrain.train.run_config import build_run_config
from rptrain.train.validate import check_inputs, check_writable, validate_config

from .job_result import check_objective
from .sweep_space import check_sweeper, sweep_jobs

CONFIG_PATH = "pkg://rptrain.conf"
CONFIG_NAME = "config"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = get_args_parser()

    def error(message: str) -> None:  # argparse would print its usage block and exit
        raise ConfigError(f"{message}: see rptrain --help")

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    commands = [args.run, args.multirun, args.cfg is not None, args.shell_completion, args.info is not None]
    if sum(map(bool, commands)) > 1:
        raise ConfigError("use only one of --run, --multirun (-m), --cfg, --info and --shell-completion")
    if args.resolve and args.cfg is None and not args.help:
        raise ConfigError("--resolve only goes with --cfg (or --help)")
    return args


def job_overrides(args: argparse.Namespace, hydra: Hydra) -> list[list[str]]:
    """One override list per job: the combinations of a -m sweep (Optuna's intervals: both ends), or the command line as is."""
    if not args.multirun:
        return [list(args.overrides)]
    return sweep_jobs(args.overrides, hydra.config_loader)


def _hydra(args: argparse.Namespace) -> Hydra:
    search_path = create_automatic_config_search_path(None, None, args.config_path or CONFIG_PATH)
    if args.config_dir is not None:
        # Where hydra.main puts --config-dir: before the structured configs.
        search_path.prepend("command-line", f"file://{os.path.abspath(args.config_dir)}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    return Hydra.create_main_hydra2(task_name="rptrain", config_search_path=search_path)


def preflight(argv: list[str]) -> Optional[Place]:
    """Raise (ConfigError, DataError, CheckpointError or Hydra's own) if any job would fail to start.
    Returns where the run (or the sweep) goes, for rank 0 to claim; None when nothing runs here."""
    args = parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return  # Hydra answers these without running anything
    if args.config_path and not (args.config_path.startswith("pkg://") or os.path.isabs(args.config_path)):
        return  # a path relative to the calling file: only hydra.main can resolve it
    running = args.cfg is None
    place = None
    try:
        hydra = _hydra(args)
        for job_num, overrides in enumerate(job_overrides(args, hydra)):
            cfg = hydra.compose_config(args.config_name or CONFIG_NAME, overrides, run_mode=RunMode.RUN, with_log_configuration=False)
            check_inside_run_dir(cfg.hydra)
            job_cfg = _without_hydra(cfg)  # what the job itself will see
            validate_config(job_cfg)
            check_objective(job_cfg)
            check_loggers(job_cfg)
            if args.multirun:
                check_sweeper(cfg.hydra, args.overrides)
            if running:
                place = check_job(job_cfg, overrides, cfg.hydra, multirun=args.multirun, job_num=job_num)
    finally:
        GlobalHydra.instance().clear()
    return place


def check_inside_run_dir(hydra_cfg: DictConfig) -> None:
    """hydra.job.name names the log file (RUN_DIR/NAME.log) and hydra.output_subdir Hydra's folder in the run
    directory: neither may point outside it."""
    name, subdir = hydra_cfg.job.name, hydra_cfg.output_subdir
    if not re.fullmatch(r"[\w][\w.+-]*", str(name)):
        raise ConfigError(f"hydra.job.name={name!r}: the job's name is a file name in the run directory (RUN_DIR/NAME.log): "
                          f"letters, digits, '_', '-', '.' and '+' only")
    if subdir is not None and (Path(str(subdir)).is_absolute() or ".." in Path(str(subdir)).parts or str(subdir).strip() in ("", ".")):
        raise ConfigError(f"hydra.output_subdir={subdir!r}: Hydra's folder goes inside the run directory: give a relative "
                          f"name such as .hydra (no '..', not absolute), or null for none")


def compose_job(argv: list[str], flag: str = "--explain") -> DictConfig:
    """One run's config as its job would see it, composed without running it (rptrain --explain, --preview)."""
    args = parse_args(argv)
    if args.multirun or args.cfg is not None or args.help or args.hydra_help or args.info or args.shell_completion:
        raise ConfigError(f"{flag} takes one run's overrides: leave out -m, --cfg, --help, --info and --shell-completion")
    try:
        cfg = _hydra(args).compose_config(args.config_name or CONFIG_NAME, list(args.overrides), run_mode=RunMode.RUN,
                                          with_log_configuration=False)
    finally:
        GlobalHydra.instance().clear()
    return _without_hydra(cfg)


def _without_hydra(cfg: DictConfig) -> DictConfig:
    job_cfg = copy.copy(cfg)
    with open_dict(job_cfg):
        del job_cfg["hydra"]
    return job_cfg


def check_job(cfg: DictConfig, overrides: list[str], hydra_cfg: DictConfig, multirun: bool, job_num: int = 0) -> Optional[Place]:
    if dist.local_rank() == 0:  # the machine's other ranks wait for it (dist.setup's barrier)
        check_inputs(cfg)
    dtype = torch_dtype(cfg.precision.compute_dtype)
    model = build_model(cfg, dtype, device="meta", vocab_size=_data_vocab(cfg))
    build_run_config(cfg.run_config, len(model))
    if dist.rank() != 0:
        return None
    key, directory = ("hydra.sweep.dir", hydra_cfg.sweep.dir) if multirun else ("hydra.run.dir", hydra_cfg.run.dir)
    check_writable(Path(directory), key)
    explicit = any(o.lstrip("+~").split("=", 1)[0] == key for o in hydra_cfg.overrides.hydra)
    run_dir: Optional[Path] = None if multirun else Path(hydra_cfg.run.dir)
    given = run_dir if explicit else None
    if explicit and multirun:
        given = _sweep_job_dir(hydra_cfg, job_num)
    if given is not None:  # a directory of the user's choosing: it may hold a run already (a new one never does)
        check_belongs(given, yaml.safe_load(OmegaConf.to_yaml(cfg)), cfg.trainer.resume is not None, key)
    choice = resolve_resume(cfg.trainer.resume, Path(cfg.output_root), run_dir, overrides)
    if choice.path is not None:
        state = load_checkpoint(choice.path, fingerprint(cfg.model.name, model))
        check_resume_state(choice.path, state, cfg)
    try:
        return plan(key, Path(directory), explicit, None if multirun else choice.run_dir)
    except AlreadyCompleted as done:
        done.dist = cfg.dist  # under torchrun rank 0 still tells the other ranks (dist.end_before_start)
        raise


def _sweep_job_dir(hydra_cfg: DictConfig, job_num: int) -> Optional[Path]:
    """Where the basic sweeper puts job `job_num` (other sweepers number their jobs as they draw them)."""
    if not str(hydra_cfg.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    try:
        with open_dict(hydra_cfg):
            hydra_cfg.job.num = job_num
        return Path(hydra_cfg.sweep.dir) / str(hydra_cfg.sweep.subdir)
    except OmegaConfBaseException:
        return None


def _data_vocab(cfg: DictConfig) -> Optional[int]:
    if model_kind(cfg.model) != LM:
        return None
    if cfg.data.name == "synthetic_tokens":
        return cfg.data.vocab_size
    from rptrain.train.tokenizer import build_tokenizer

    return build_tokenizer(cfg).vocab_size


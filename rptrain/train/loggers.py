"""Experiment trackers behind logger=[jsonl, tensorboard, wandb, mlflow]: one small interface.

metrics.jsonl/.csv (MetricsLog) are always written. Each other tracker receives the config when
the run starts, every metrics record as it is added (`kind/name` scalars at the record's step:
train/loss, eval/acc, epoch/train_loss, ...), and the final summary; only rank 0 opens them. A
tracker whose package is missing is refused before the run starts (check_loggers: one line, exit
2); W&B runs offline unless logger.wandb.mode says otherwise.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError
from .shown_config import shown_config

PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def chosen(cfg: DictConfig) -> list[str]:
    return [name for name in PACKAGES if cfg.logger.get(name) is not None]


def check_loggers(cfg: DictConfig) -> None:
    for name in chosen(cfg):
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"logger={name}: the {module} package is not installed: pip install {package} "
                              f"(or pip install 'rptrain[loggers]'), or leave {name} out of logger=[...]")


def _scalars(record: dict) -> dict[str, float]:
    """A metrics record's numbers as `kind/name` (the step is the x axis, not a scalar)."""
    return {f"{record['kind']}/{k}": float(v) for k, v in record.items()
            if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _final(summary: dict) -> dict[str, float]:
    values = {f"final/{k}": v for k, v in summary.get("final", {}).items()}
    values.update({f"final/{k}": summary[k] for k in ("samples_per_s", "tokens_per_s", "train_seconds") if k in summary})
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


class TensorBoard:
    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / cfg.logger.tensorboard.log_dir))
        self.writer.add_text("config", _yaml_block(config))

    def log(self, record: dict) -> None:
        for name, value in _scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def finish(self, summary: Optional[dict], state: str) -> None:
        if summary is not None:
            for name, value in _final(summary).items():
                self.writer.add_scalar(name, value, summary["steps"])
            self.writer.add_text("summary", f"```\n{json.dumps(summary, indent=2, default=str)}\n```", summary["steps"])
        self.writer.close()


class Wandb:
    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict) -> None:
        import wandb

        c = cfg.logger.wandb
        self.run = wandb.init(project=c.project, entity=c.entity, name=c.name or run_dir.name, tags=list(c.tags),
                              mode=c.mode, dir=str(run_dir), config=config)

    def log(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def finish(self, summary: Optional[dict], state: str) -> None:
        if summary is not None:
            self.run.summary.update({**_final(summary), "steps": summary["steps"], "status": summary["status"]})
        self.run.finish(exit_code=0 if state == "completed" else 1)


class Mlflow:
    STATES = {"completed": "FINISHED", "interrupted": "KILLED", "killed": "KILLED"}  # anything else: FAILED

    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict) -> None:
        import mlflow

        c = cfg.logger.mlflow
        self.mlflow = mlflow
        if c.tracking_uri is None:  # MLflow 3 refuses a file store unless asked: it wants a database, whose setup takes seconds
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(c.tracking_uri or (run_dir / "mlruns").resolve().as_uri())
        client = mlflow.MlflowClient()  # not set_experiment: it announces a new experiment on stderr
        experiment = client.get_experiment_by_name(c.experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(c.experiment_name)
        mlflow.start_run(experiment_id=experiment_id, run_name=c.run_name or run_dir.name)
        mlflow.log_params(_flat(config))
        mlflow.log_dict(config, "config.yaml")

    def log(self, record: dict) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in _scalars(record).items()}, step=record["step"])

    def finish(self, summary: Optional[dict], state: str) -> None:
        if summary is not None:
            self.mlflow.log_metrics({k.replace("/", "."): v for k, v in _final(summary).items()}, step=summary["steps"])
            self.mlflow.log_dict(summary, "summary.json")
        self.mlflow.end_run(status=self.STATES.get(state, "FAILED"))


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}


class Loggers:
    """The chosen trackers as one: log(record) per metrics record, finish(summary or None, state) once."""

    def __init__(self, cfg: Optional[DictConfig] = None, run_dir: Optional[Path] = None) -> None:
        self.trackers: list[Any] = []
        if cfg is None:
            return  # the other ranks of a torchrun job: nothing to open
        check_loggers(cfg)
        config = shown_config(cfg)  # values from the environment (API keys) as written, not resolved
        self.trackers = [TRACKERS[name](cfg, Path(run_dir), config) for name in chosen(cfg)]

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def finish(self, summary: Optional[dict], state: str) -> None:
        trackers, self.trackers = self.trackers, []  # once, even if a tracker fails to close
        for tracker in trackers:
            tracker.finish(summary, state)


def _flat(tree: Any, prefix: str = "") -> dict[str, str]:
    """A config tree as dotted keys (MLflow params are flat strings)."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): str(tree)[:500]}


def _yaml_block(config: dict) -> str:
    return "```\n" + OmegaConf.to_yaml(OmegaConf.create(config)) + "```"  # TensorBoard renders text as markdown

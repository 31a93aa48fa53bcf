"""Setup: everything one run trains with, built from its config, as one typed record.

Order matters: the data fixes the vocabulary the model is built with; the checkpoint to resume from
is chosen (rank 0 for all) and checked against the model's fingerprint before the engine takes the
weights; the optimizer is made over the engine's master parameters, then everything is restored.
The checkpoint's states go out of scope when setup returns: a big one does not stay mapped all run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from rich.console import Console
from torch.optim.lr_scheduler import LRScheduler

from rptrain import GradScaler, OptimizerCtx, RoundPipe

from .checkpoint import load_checkpoint
from .console import log, say
from .data import TrainData, build_data
from .dist import Dist, peer_errors
from .memory_format import choose_memory_format
from .meters import RunProgress, rank_share
from .metrics import MetricsLog
from .model import build_model, fingerprint
from .optim import build_optimizer, master_dtype, optimizer_memory
from .precision import build_scaler, torch_dtype
from .report import Report
from .resume import check_resume_state
from .run_checkpoints import RunCheckpoints, choose_resume, restore
from .run_config import build_run_config
from .samples import Sampler, make_sampler
from .step_fn import StepFunctions
from .tasks import Task, make_task
from .validate import check_vocab, num_microbatch, validate_config


@dataclass
class Components:
    engine: RoundPipe
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    scaler: GradScaler
    steps: StepFunctions  # what each engine.step runs, and the watch for non-finite losses
    data: TrainData
    task: Task
    sampler: Optional[Sampler]  # trainer.sample_prompts, answered at every evaluation
    metrics: MetricsLog
    report: Report
    checkpoints: RunCheckpoints
    progress: RunProgress
    dtype: torch.dtype  # the compute dtype
    total_steps: int
    num_epochs: int
    resume: Optional[Path]  # the checkpoint this run continues

    def close(self) -> None:
        try:
            self.metrics.close()
        finally:
            self.engine.close()


def build_engine(cfg: DictConfig, model: torch.nn.Sequential, d: Dist) -> RoundPipe:
    with peer_errors("the comparison of the ranks' initial weights", d.world > 1):
        return RoundPipe(model, master_dtype(cfg.optim), build_run_config(cfg.run_config, len(model)), optimizer=optimizer_memory(cfg.optim),
                         devices=d.devices, process_group=d.group, cuda_graphs=cfg.engine.cuda_graphs,
                         optimizer_threads=cfg.engine.optimizer_threads,
                         max_host_memory=cfg.engine.max_host_memory, max_gpu_memory=cfg.engine.max_gpu_memory,
                         gpu_state=cfg.engine.gpu_state, memory_format=choose_memory_format(cfg.engine.channels_last, model, d.devices))


def build_data_and_model(cfg: DictConfig) -> tuple[torch.dtype, TrainData, torch.nn.Sequential]:
    """The compute dtype, the data, and the model seeded by trainer.seed (built after the data,
    which fixes a language model's null vocab_size)."""
    validate_config(cfg)
    dtype = torch_dtype(cfg.precision.compute_dtype)
    torch.manual_seed(cfg.trainer.seed)
    data = build_data(cfg, dtype)
    check_vocab(cfg, data.vocab_size)
    return dtype, data, build_model(cfg, dtype, vocab_size=data.vocab_size)


def build_components(cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console, d: Dist,
                     on_record: Any = None) -> Components:
    dtype, data, model = build_data_and_model(cfg)
    prints = fingerprint(cfg.model.name, model)
    resume = choose_resume(cfg, run_dir, overrides, d, console)
    state = load_checkpoint(resume, prints) if resume else None
    if state is not None:
        check_resume_state(resume, state, cfg)
    b = cfg.trainer.batch_size
    ranks = f"; global batch {b} = {d.world} ranks x {b // d.world}" if d.world > 1 else ""
    say(console, f"model {cfg.model.name}: {prints['params']:,} parameters, compute {dtype}; data {data.description}{ranks}")
    engine = build_engine(cfg, model, d)
    del model  # the engine owns the weights now
    try:
        log.info("engine host memory: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in engine.memory_report().items()))
        return _train_parts(cfg, run_dir, overrides, console, d, on_record, engine, data, dtype, prints, resume, state)
    except BaseException:
        engine.close()
        raise


def _train_parts(cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console, d: Dist, on_record: Any,
                 engine: RoundPipe, data: TrainData, dtype: torch.dtype, prints: dict, resume: Optional[Path], state: Optional[dict]) -> Components:
    """The optimizer and what tracks the run, around the engine, restored from `state` (a checkpoint's) when given."""
    t = cfg.trainer
    total_steps = t.max_steps or t.epochs * len(data.train)
    with OptimizerCtx():
        optimizer = build_optimizer(cfg.optim, engine.parameters())
    scheduler = instantiate(cfg.optim.schedule, optimizer=optimizer, total_steps=total_steps)
    scaler = build_scaler(cfg.precision)
    param_names = {name for name, _ in engine.named_parameters()}
    checkpoints = RunCheckpoints(cfg, run_dir, overrides, prints, d, param_names)
    progress = RunProgress()
    if state is not None:
        progress = rank_share(restore(state, resume, engine, optimizer, scheduler, scaler, data, console), d.main)
        checkpoints.last_step = progress.step
    task, sampler = make_task(data.kind, num_microbatch(cfg), dtype, d.world, t.eval_num_microbatch), make_sampler(cfg, data)
    metrics = MetricsLog(run_dir if d.main else None, state["history"] if state else None, on_record)  # opened last: nothing fails after it
    num_epochs = math.ceil(total_steps / len(data.train))
    steps = StepFunctions(optimizer, scheduler, scaler, cfg.optim.clip_grad_norm, t.on_nonfinite.value, d, checkpoints.kept)
    return Components(
        engine=engine, optimizer=optimizer, scheduler=scheduler, scaler=scaler, steps=steps, data=data, task=task,
        sampler=sampler, metrics=metrics, report=Report(console, d, metrics, task, run_dir, total_steps, num_epochs),
        checkpoints=checkpoints, progress=progress, dtype=dtype, total_steps=total_steps, num_epochs=num_epochs, resume=resume,
    )

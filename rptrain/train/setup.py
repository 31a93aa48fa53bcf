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

from rptrain import GradScaler, OptimizerCtx, RoundPipe, Tuning
from rptrain.engine import check_model_fits

from .chat_export import template_line
from .checkpoint import load_checkpoint
from .console import log, loud, say
from .data import TrainData, build_data
from .disk_check import check_disk, disk_needs, export_nbytes
from .dist import Dist, FailedOnRankZero, peer_errors
from .errors import OutputError
from .export import exportable
from .lora import wants_adapter
from .memory_format import choose_memory_format
from .meters import RunProgress, rank_share
from .metrics import MetricsLog
from .model import Materialiser, build_model, build_model_streamed, fingerprint
from .optim import build_optimizer, master_dtype, optimizer_memory
from .precision import build_scaler, torch_dtype
from .report import Report
from .resume import check_resume_state
from .run_checkpoints import RunCheckpoints, choose_resume, restore
from .run_config import build_run_config
from .samples import Sampler, make_sampler
from .step_fn import StepFunctions
from .tasks import Task, make_task
from .threads import set_threads
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
            self.checkpoints.close()
            self.metrics.close()
        finally:
            self.engine.close()


def build_engine(cfg: DictConfig, model: torch.nn.Sequential, d: Dist, materialise: Optional[Materialiser] = None) -> RoundPipe:
    """The engine around ``model``; with ``materialise`` the model is on the meta device and the engine makes
    each layer real as it takes it in (no whole host copy of the model: engine/host_fill.py)."""
    with peer_errors("the comparison of the ranks' initial weights", d.world > 1):
        return RoundPipe(model, master_dtype(cfg.optim), build_run_config(cfg.run_config, len(model), num_microbatch(cfg)), optimizer=optimizer_memory(cfg.optim),
                         devices=d.devices, process_group=d.group, cuda_graphs=cfg.engine.cuda_graphs,
                         optimizer_threads=cfg.engine.optimizer_threads,
                         max_host_memory=cfg.engine.max_host_memory, max_gpu_memory=cfg.engine.max_gpu_memory,
                         gpu_state=cfg.engine.gpu_state, single_version=cfg.engine.single_version, memory_format=choose_memory_format(cfg.engine.channels_last, model, d.devices),
                         tuning=Tuning(compile_stages=cfg.engine.compile, fuse_microbatches=cfg.engine.fuse_microbatches),
                         keep_user_weights=False,  # the run reads weights through state_dict(): no host copy of a resident model
                         materialise=materialise)


def build_data_and_model(cfg: DictConfig, d: Optional[Dist] = None) -> tuple[torch.dtype, TrainData, torch.nn.Sequential, Optional[Materialiser]]:
    """The compute dtype, the data, and the model seeded by trainer.seed (built after the data,
    which fixes a language model's null vocab_size). With ``d``, the engine's fit check runs first
    on the model built on the meta device: a model that cannot fit is refused (DoesNotFit, one line)
    before its weights are allocated and initialised. The model is returned on the meta device with
    its Materialiser where the engine can make it real layer by layer (build_model_streamed), else real
    and None."""
    validate_config(cfg)
    dtype = torch_dtype(cfg.precision.compute_dtype)
    torch.manual_seed(cfg.trainer.seed)
    data = build_data(cfg, dtype)
    check_vocab(cfg, data.vocab_size)
    if d is not None:  # meta tensors draw no random numbers: the model below is initialised as without this
        e = cfg.engine
        check_model_fits(build_model(cfg, dtype, device="meta", vocab_size=data.vocab_size), master_dtype(cfg.optim), d.devices,
                         max_host_memory=e.max_host_memory, max_gpu_memory=e.max_gpu_memory, gpu_state=e.gpu_state,
                         optimizer=optimizer_memory(cfg.optim), single_version=e.single_version)
    return dtype, data, *build_model_streamed(cfg, dtype, vocab_size=data.vocab_size)


def build_components(cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console, d: Dist,
                     on_record: Any = None) -> Components:
    threads = set_threads(cfg.engine.threads, cfg.engine.optimizer_threads, torch.cuda.is_available())
    dtype, data, model, maker = build_data_and_model(cfg, d)
    prints = fingerprint(cfg.model.name, model)
    resume = choose_resume(cfg, run_dir, overrides, d, console)
    state = load_checkpoint(resume, prints) if resume else None
    if state is not None:
        check_resume_state(resume, state, cfg)
    b = cfg.trainer.batch_size
    ranks = f"; global batch {b} = {d.world} ranks x {b // d.world}" if d.world > 1 else ""
    trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
    share = f" ({trainable:,} trainable, {trainable / max(prints['params'], 1):.2%})" if trainable != prints["params"] else ""
    say(console, f"model {cfg.model.name}: {prints['params']:,} parameters{share}, compute {dtype}; data {data.description}{ranks}")
    say(console, threads)
    if data.template is not None:
        loud(console, template_line(data.template, data.tokenizer))
    engine = build_engine(cfg, model, d, maker)
    del model, maker  # the engine owns the weights now
    try:
        log.info("engine host memory: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in engine.memory_report().items()))
        return _train_parts(cfg, run_dir, overrides, console, d, on_record, engine, data, dtype, prints, resume, state)
    except BaseException:
        engine.close()
        raise


def check_checkpoint_space(cfg: DictConfig, run_dir: Path, engine: RoundPipe, optimizer: torch.optim.Optimizer,
                           dtype: torch.dtype, console: Console, d: Dist) -> None:
    """Refuse a run whose next checkpoint cannot fit on the output file system (disk_check.py); say
    when fewer than trainer.keep_checkpoints + 1 fit, else log the numbers. Rank 0 writes the
    checkpoints, so it checks, and every rank stops with it."""
    error = None
    if d.main:
        state = engine.master_state()
        exports = cfg.trainer.hf_export and exportable(cfg) and not wants_adapter(cfg)
        needs = disk_needs(Path(run_dir) / "checkpoints", state, optimizer, cfg.trainer.keep_checkpoints,
                           export_nbytes(state, dtype) if exports else 0)
        try:
            note = check_disk(needs)
        except OutputError as err:
            error, note = err, None
        if note is not None:
            say(console, note)
        elif error is None:
            log.info(needs.line())
    message = d.broadcast(str(error) if error else None, "the checkpoint disk check")
    if error is not None:
        raise error
    if message is not None:
        raise FailedOnRankZero(message)


def _train_parts(cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console, d: Dist, on_record: Any,
                 engine: RoundPipe, data: TrainData, dtype: torch.dtype, prints: dict, resume: Optional[Path], state: Optional[dict]) -> Components:
    """The optimizer and what tracks the run, around the engine, restored from `state` (a checkpoint's) when given."""
    t = cfg.trainer
    total_steps = t.max_steps or t.epochs * len(data.train)
    with OptimizerCtx():
        optimizer = build_optimizer(cfg.optim, engine.parameters())
    scheduler = instantiate(cfg.optim.schedule, optimizer=optimizer, total_steps=total_steps)
    warmup = cfg.optim.schedule.get("warmup_steps") or 0
    if warmup > total_steps and d.main:
        loud(console, f">>> optim.schedule.warmup_steps={warmup} is more than the run's {total_steps} steps: the learning rate never "
                      f"reaches optim.optimizer.lr={cfg.optim.optimizer.lr:g} (it ends at {total_steps / warmup:.0%} of it); "
                      f"lower optim.schedule.warmup_steps or train longer")
    samples = data.train.num_samples
    if samples < t.batch_size and d.main:  # a DataLoader with drop_last=False does the same, silently
        loud(console, f">>> the training data has {samples} samples, fewer than trainer.batch_size={t.batch_size}: every step "
                      f"trains on those {samples}; lower trainer.batch_size or add data")
    scaler = build_scaler(cfg.precision)
    param_names = {name for name, _ in engine.named_parameters()}
    checkpoints = RunCheckpoints(cfg, run_dir, overrides, prints, d, param_names)
    progress = RunProgress()
    if state is not None:
        progress = rank_share(restore(state, resume, engine, optimizer, scheduler, scaler, data, console), d.main)
        checkpoints.last_step = progress.step
    check_checkpoint_space(cfg, run_dir, engine, optimizer, dtype, console, d)
    task, sampler = make_task(data.kind, num_microbatch(cfg), dtype, d.world, t.eval_num_microbatch), make_sampler(cfg, data)
    metrics = MetricsLog(run_dir if d.main else None, state["history"] if state else None, on_record)  # opened last: nothing fails after it
    num_epochs = math.ceil(total_steps / len(data.train))
    steps = StepFunctions(optimizer, scheduler, scaler, cfg.optim.clip_grad_norm, t.on_nonfinite.value, d, checkpoints.kept)
    return Components(
        engine=engine, optimizer=optimizer, scheduler=scheduler, scaler=scaler, steps=steps, data=data, task=task,
        sampler=sampler, metrics=metrics, report=Report(console, d, metrics, task, run_dir, total_steps, num_epochs),
        checkpoints=checkpoints, progress=progress, dtype=dtype, total_steps=total_steps, num_epochs=num_epochs, resume=resume,
    )

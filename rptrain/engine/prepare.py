"""One call's preparation: run config, plan and schedule, the same for every kind of call.

``forward_backward``, ``model(x)`` with autograd (and the backward it records: recorded.py), a
plain forward and ``explain()`` all start here: the call's run config is resolved against the
engine's, the plan chosen (a pinned ``ExecutePlan`` or ``ModelExecutePlan``, else the planner's:
planning.py) and turned into jobs (schedule.py). The executor lowers the jobs (actions.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .config import ResolvedRunConfig, RoundPipeRunConfig, default_microbatches, resolve
from .model_plan import ModelExecutePlan
from .plan import ExecutePlan
from .planning import Planner
from .schedule import Job, backward_schedule, forward_schedule, training_schedule


@dataclass(frozen=True)
class Prepared:
    cfg: ResolvedRunConfig
    plan: ExecutePlan
    jobs: tuple[Job, ...]
    profile: bool = False  # this call measures every layer (planning.py)
    offload: bool = False  # saved activations go to the host
    recorded: bool = False  # model(x) saving what a later backward needs (recorded.py)


class Preparer:
    def __init__(self, run_config: RoundPipeRunConfig, num_layers: int, num_devices: int, cuda: bool, planner: Planner):
        self.run_config, self.num_layers, self.num_devices, self.planner = run_config, num_layers, num_devices, planner
        self.default_microbatches = default_microbatches(num_devices, cuda)
        self.enclosing: Optional[RoundPipeRunConfig] = None  # set while an enclosing call runs this engine per microbatch (wrap.py)
        if run_config.execute_plan is not None:
            self._pinned(run_config.execute_plan, fused=isinstance(run_config.execute_plan, ExecutePlan))

    def resolve(self, run_config: Optional[RoundPipeRunConfig]) -> ResolvedRunConfig:
        return resolve(self.run_config.override(self.enclosing).override(run_config), self.default_microbatches)

    def training(self, run_config: Optional[RoundPipeRunConfig]) -> Prepared:
        """``forward_backward``: forward stages, the fused last stage, backward stages."""
        cfg = self.resolve(run_config)
        if cfg.execute_plan is not None:
            plan, profile = self._pinned(cfg.execute_plan, fused=True), False
        else:
            plan, profile = self.planner.training(cfg)
        jobs = training_schedule(plan, self.num_devices, cfg.recompute_grain)
        return Prepared(cfg, plan, jobs, profile, self.planner.offload(jobs, cfg.num_microbatch))

    def forward(self, run_config: Optional[RoundPipeRunConfig]) -> Prepared:
        """``model(x)``: recorded for a later backward when the call requires grad, else a plain forward."""
        cfg = self.resolve(run_config)
        plan = self._pinned(cfg.execute_plan, fused=False) if cfg.execute_plan is not None else self.planner.forward(cfg)
        recorded = cfg.requires_grad and torch.is_grad_enabled()
        jobs = forward_schedule(plan, self.num_devices, save_for_backward=recorded, grain=cfg.recompute_grain if recorded else "stage")
        return Prepared(cfg, plan, jobs, recorded=recorded)

    def backward_jobs(self, forward: Prepared) -> tuple[Job, ...]:
        """The backward of a recorded forward call: it starts on the device after the forward's last."""
        return backward_schedule(forward.plan, self.num_devices, forward.cfg.recompute_grain, len(forward.jobs))

    def _pinned(self, plan: ExecutePlan | ModelExecutePlan, fused: bool) -> ExecutePlan:
        if isinstance(plan, ModelExecutePlan):
            plan = plan.to_plan(fused)
        plan.check_layers(self.num_layers)
        return plan

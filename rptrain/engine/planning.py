"""Which plan a call runs: pinned, planned from sizes (CPU) or measured by the first call (GPU).

On a GPU the first training call runs one layer per stage and measures every layer (time,
activation and saved bytes); the plan follows from that (plan.py). The measured activation bytes
also decide whether saved activations move to host memory (``Tuning.offload_share``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from . import timer
from .config import ResolvedRunConfig
from .device import Device
from .host import HostState
from .passstate import PassState
from .plan import ExecutePlan, LayerCost, LayerTooLarge, plan_stages
from .schedule import JobKind
from .tuning import Tuning


class Planner:
    def __init__(self, num_layers: int, host: HostState, devices: Sequence[Device], tuning: Tuning, reducer: Any,
                 streams_weights: bool = True):
        """``streams_weights``: stages upload their weights (a GPU not keeping the model resident), so measured
        plans balance bytes at ``tuning.transfer_rate`` as well as compute."""
        self.num_layers, self.host, self.devices, self.tuning, self.reducer = num_layers, host, devices, tuning, reducer
        self.cuda = devices[0].is_cuda
        self.transfer_rate = tuning.transfer_rate if streams_weights and self.cuda else None
        self.plan: Optional[ExecutePlan] = None  # the planner's choice (None until planned)
        self.costs: Optional[list[LayerCost]] = None  # measured by the first call on a GPU
        self.activation_bytes: Optional[dict[int, int]] = None  # measured: one microbatch's output per layer
        self.measured_joined = False  # whether that microbatch was a call's microbatches joined (fused_call.py): the whole batch
        self.keeps_apart: Optional[str] = None  # why later calls must run their microbatches apart (the joined batch is too large)
        self.memory_cap = 0

    def static_costs(self) -> list[LayerCost]:
        layout, frozen = self.host.params, self.host.frozen_layout
        costs = []
        for i in range(self.num_layers):
            nbytes = layout.nbytes(i, i + 1) + frozen.nbytes(i, i + 1)
            grad_bytes = sum(s.numel * layout.dtypes[s.key].itemsize for s in layout.slots_of(i, i + 1))
            costs.append(LayerCost(nbytes, grad_bytes, float(nbytes + 1), 2.0 * (nbytes + 1)))
        return costs

    def training(self, cfg: "ResolvedRunConfig") -> tuple[ExecutePlan, bool]:
        if cfg.execute_plan is not None:
            return cfg.execute_plan, False
        if self.plan is None:
            if self.cuda:  # measure every layer once (one layer per stage always fits), then plan
                return ExecutePlan.per_layer(self.num_layers), True
            self.plan = plan_stages(self.static_costs(), len(self.devices))
        return self.plan, False

    def auto(self, min_stages: Optional[int], memory_cap: Optional[int]) -> ExecutePlan:
        """``ExecutePlan.auto``: the measured costs when a call has measured them, else the sizes."""
        cap = memory_cap or self._cap()
        rate = self.transfer_rate if self.costs else None  # static costs are sizes, not seconds
        return plan_stages(self.costs or self.static_costs(), max(1, min_stages or len(self.devices)), cap, rate)

    def _cap(self) -> Optional[int]:
        """Bytes a device may use for a stage: its cap less the GPU share's optimizer state (gpushare.py)."""
        cap = min(d.memory_cap() or 0 for d in self.devices)
        state = self.host.gpu.state_bytes() if self.host.gpu is not None else 0
        return max(cap - state, 1) if cap else None

    def forward(self, cfg: "ResolvedRunConfig") -> ExecutePlan:
        if cfg.execute_plan is not None:
            return cfg.execute_plan
        if self.plan is None and not self.cuda:
            self.plan = plan_stages(self.static_costs(), len(self.devices))
        return self.plan or ExecutePlan.per_layer(self.num_layers)

    def offload(self, jobs: list, num_microbatch: int) -> bool:
        """Move saved activations to the host when keeping them would take over ``tuning.offload_share`` of the GPU."""
        if not self.cuda:
            return False
        if self.tuning.offload_activations is not None:
            return self.tuning.offload_activations
        if self.activation_bytes is None:
            return False
        saved = sum(self.activation_bytes.get(c - 1, 0) for job in jobs if job.kind is JobKind.FORWARD for c in job.checkpoints)
        # Measured joined, the bytes are already the whole batch's: apart or joined, a call keeps every microbatch's inputs.
        return saved * (1 if self.measured_joined else num_microbatch) > self.tuning.offload_share * self.memory_cap

    def measured(self, state: PassState) -> None:
        """Turn a measured one-layer-per-stage call into layer costs and a plan."""
        forward: dict[int, float] = {}
        backward: dict[int, float] = {}
        for job, device, start, stop in state.timings:
            seconds = device.elapsed(start, stop)
            if job.kind is JobKind.FORWARD:
                forward[job.start] = seconds
            elif job.kind is JobKind.FUSED:
                forward[job.start], backward[job.start] = seconds / 3, 2 * seconds / 3
            else:
                backward[job.start] = seconds
        base = self.static_costs()
        costs = [
            LayerCost(
                c.param_bytes, c.grad_bytes, forward.get(i, 0.0) + 1e-7,
                max(backward.get(i, 0.0) - forward.get(i, 0.0), 0.0) + 1e-7,
                state.activation_bytes.get(i, 0), state.saved_bytes.get(i, 0),
            )
            for i, c in enumerate(base)
        ]
        cap = self._cap()
        timer.report(costs)  # rptrain.timer.ModelTimer.VERBOSE: the original library's per-layer printout
        joined, share = state.fused_sizes, 1.0
        try:
            plan = plan_stages(costs, len(self.devices), cap, self.transfer_rate)
        except LayerTooLarge:
            if joined is None:
                raise
            # Measured with the microbatches joined, one layer's graph is over the cap; apart, each holds only its
            # own microbatch's. Plan for that, and the calls after this one run them apart (roundpipe.py).
            share = max(joined) / sum(joined)
            costs = [dataclasses.replace(c, activation_bytes=int(c.activation_bytes * share), saved_bytes=int(c.saved_bytes * share))
                     for c in costs]
            plan = plan_stages(costs, len(self.devices), cap, self.transfer_rate)
            self.keeps_apart, joined = "a layer's activations for the joined batch do not fit the GPU's memory cap", None
        self.costs = costs
        self.plan = same_on_all_ranks(self.reducer, plan)
        self.activation_bytes, self.memory_cap = {i: int(b * share) for i, b in state.activation_bytes.items()}, cap or 0
        self.measured_joined = joined is not None


def same_on_all_ranks(reducer: Any, value: Any) -> Any:
    """Rank 0's decision everywhere: plans fix the order of the gradient collectives."""
    return value if reducer is None else reducer.broadcast_object(value)

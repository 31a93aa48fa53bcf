"""Execution plans: which layers form each stage. Pure Python, no torch.

A plan has forward stages and backward stages, both contiguous runs of layers covering the model.
Their last stage is the same and runs fused: forward, loss and backward of that stage in one job,
with no recompute. The other backward stages recompute their forward from saved inputs.

``plan_stages`` picks the boundaries: balance stage times under a memory cap per device, with the
largest fused last stage that fits (every layer in it is one recompute saved). A stage's time is
its compute or, given a transfer rate, its weights' transfer, whichever is longer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

Stages = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ExecutePlan:
    """Stage boundaries as ``((start, stop), ...)`` runs of layer indices.

    ``ExecutePlan.from_cuts(10, forward=[4, 7], backward=[2, 7])`` splits 10 layers into forward
    stages [0,4) [4,7) [7,10) and backward stages [0,2) [2,7) [7,10).
    """

    forward: Stages
    backward: Stages
    fused: bool = True  # False: a plan for model(x) + backward only, whose last stages may differ (ModelExecutePlan)

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", tuple(tuple(s) for s in self.forward))
        object.__setattr__(self, "backward", tuple(tuple(s) for s in self.backward))
        for name in ("forward", "backward"):
            stages = getattr(self, name)
            if not stages:
                raise ValueError(f"ExecutePlan.{name} needs at least one stage")
            if stages[0][0] != 0:
                raise ValueError(f"ExecutePlan.{name} must start at layer 0, got {stages[0]}")
            for (a, b), (c, _) in zip(stages, stages[1:] + ((stages[-1][1], None),)):
                if not (isinstance(a, int) and isinstance(b, int)) or b <= a:
                    raise ValueError(f"ExecutePlan.{name} has an empty or reversed stage ({a}, {b})")
                if c != b:
                    raise ValueError(f"ExecutePlan.{name} stages must be contiguous: ({a}, {b}) is followed by a stage starting at {c}")
        if self.fused and self.forward[-1] != self.backward[-1]:
            raise ValueError(
                f"ExecutePlan: the last forward stage {self.forward[-1]} and the last backward stage "
                f"{self.backward[-1]} must be the same (it runs forward, loss and backward fused)"
            )
        if self.forward[-1][1] != self.backward[-1][1]:
            raise ValueError("ExecutePlan: forward and backward stages must cover the same layers")

    @property
    def num_layers(self) -> int:
        return self.forward[-1][1]

    @classmethod
    def from_cuts(cls, num_layers: int, forward: Sequence[int] = (), backward: Optional[Sequence[int]] = None) -> "ExecutePlan":
        def stages(cuts: Sequence[int]) -> Stages:
            points = [0, *cuts, num_layers]
            return tuple(zip(points[:-1], points[1:]))

        return cls(stages(forward), stages(forward if backward is None else backward))

    @classmethod
    def single_stage(cls, num_layers: int) -> "ExecutePlan":
        return cls.from_cuts(num_layers)

    @classmethod
    def per_layer(cls, num_layers: int) -> "ExecutePlan":
        return cls.from_cuts(num_layers, range(1, num_layers))

    @classmethod
    def auto(cls, run_type: str, *models: Any, min_stages: Optional[int] = None, upper_threshold: float = 1.1,
             model_memory_limit: Optional[float] = None) -> "ExecutePlan | list[ExecutePlan]":
        """The planner's plan for each ``RoundPipe`` (the original library's signature): from the
        layer times measured so far, else from the layer sizes. ``run_type`` is "infer", "train"
        or "fused" (one plan serves all three here); ``min_stages`` defaults to the number of
        devices; ``model_memory_limit`` in GiB caps a stage at half of it; ``upper_threshold``
        is accepted and unused (the planner balances stage times itself)."""
        if run_type not in ("infer", "train", "fused"):
            raise ValueError(f"ExecutePlan.auto: run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
        if not models:
            raise ValueError("ExecutePlan.auto needs at least one RoundPipe model")
        cap = None if model_memory_limit is None else int(model_memory_limit * 2**30 / 2)
        plans = [model._auto_plan(min_stages, cap) for model in models]
        return plans[0] if len(plans) == 1 else plans

    def check_layers(self, num_layers: int) -> None:
        if self.num_layers != num_layers:
            raise ValueError(f"ExecutePlan covers {self.num_layers} layers but the model has {num_layers}")


class LayerTooLarge(ValueError):
    """One layer alone needs more than the device memory cap."""


@dataclass(frozen=True)
class LayerCost:
    """What the planner knows about one layer. Times are for one call (all microbatches)."""

    param_bytes: int
    grad_bytes: int
    forward_time: float
    backward_time: float  # excluding the recompute
    activation_bytes: int = 0  # one microbatch's output
    saved_bytes: int = 0  # one microbatch's autograd graph


def forward_memory(costs: Sequence[LayerCost], a: int, b: int) -> int:
    """Weights twice (the next stage uploads while this one runs) plus one microbatch in flight."""
    weights = sum(c.param_bytes for c in costs[a:b])
    live = max(c.activation_bytes for c in costs[a:b]) * 2
    return 2 * weights + live


def backward_memory(costs: Sequence[LayerCost], a: int, b: int) -> int:
    """Weights twice, gradients plus their fp32 copy for download, one microbatch's graph."""
    weights = sum(c.param_bytes for c in costs[a:b])
    grads = sum(c.grad_bytes for c in costs[a:b])
    graph = sum(c.saved_bytes + c.activation_bytes for c in costs[a:b])
    return 2 * weights + 3 * grads + graph


Cost = tuple[float, ...]  # one layer's seconds on each resource a stage uses at once: compute, upload, download


def _part_cost(costs: Sequence[Cost], a: int, b: int) -> float:
    """A stage's time: its busiest resource (weights stream in while the previous stage computes)."""
    return max(sum(c[k] for c in costs[a:b]) for k in range(len(costs[a])))


def _min_parts(costs: list[Cost], fits, a: int, b: int, limit: float) -> Optional[list[int]]:
    """Greedy cut points splitting [a, b) into the fewest parts of cost <= limit that fit."""
    cuts, start, totals = [], a, [0.0] * len(costs[a])
    for i in range(a, b):
        grown = [t + c for t, c in zip(totals, costs[i])]
        if i > start and (max(grown) > limit or not fits(start, i + 1)):
            cuts.append(i)
            start, grown = i, list(costs[i])
        if not fits(start, i + 1):
            return None  # a single layer does not fit
        totals = grown
    return cuts


def _partition(costs: list[Cost], fits, a: int, b: int, min_parts: int) -> list[int]:
    """Cut points splitting [a, b) into at least ``min_parts`` parts, minimising the costliest part."""
    if b - a <= 0:
        return []
    min_parts = min(min_parts, b - a)
    fewest = _min_parts(costs, fits, a, b, float("inf"))
    if fewest is None:
        raise LayerTooLarge("a single layer does not fit in the device memory cap; give the engine more memory or split the layer")
    lo, hi = max(_part_cost(costs, i, i + 1) for i in range(a, b)), _part_cost(costs, a, b)
    best = fewest
    for _ in range(60):  # bisection on the costliest part
        mid = (lo + hi) / 2
        cuts = _min_parts(costs, fits, a, b, mid)
        if cuts is not None and len(cuts) + 1 <= max(min_parts, len(fewest) + 1):
            best, hi = cuts, mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
    cuts = list(best)
    # Split the largest parts until there are enough of them (splitting never raises the maximum).
    while len(cuts) + 1 < min_parts:
        points = [a, *cuts, b]
        widest = max(range(len(points) - 1), key=lambda k: (points[k + 1] - points[k] > 1, _part_cost(costs, points[k], points[k + 1])))
        lo_i, hi_i = points[widest], points[widest + 1]
        whole, cut = _part_cost(costs, lo_i, hi_i), lo_i + 1
        for i in range(lo_i, hi_i - 1):
            cut = i + 1
            if _part_cost(costs, lo_i, i + 1) >= whole / 2:
                break
        cuts = sorted(cuts + [cut])
    return cuts


def plan_stages(costs: Sequence[LayerCost], num_devices: int = 1, memory_cap: Optional[int] = None,
                transfer_rate: Optional[float] = None) -> ExecutePlan:
    """Choose stage boundaries for ``costs`` on ``num_devices`` devices of ``memory_cap`` bytes each.

    ``transfer_rate`` (bytes per second between host and device, each direction): stages are balanced
    by bytes as well as by compute, a stage taking as long as its compute or its weights' upload (and,
    backward, its gradients' download), whichever is longer. An MoE layer holds many times a dense
    layer's weights for the same FLOPs, so balancing compute alone would give its stages the longest
    transfers. None: compute alone."""
    n = len(costs)
    if n == 0:
        raise ValueError("the model has no layers")
    costs = list(costs)

    def fits_fwd(a: int, b: int) -> bool:
        return memory_cap is None or forward_memory(costs, a, b) <= memory_cap

    def fits_bwd(a: int, b: int) -> bool:
        return memory_cap is None or backward_memory(costs, a, b) <= memory_cap

    def upload(c: LayerCost) -> Cost:
        return () if transfer_rate is None else (c.param_bytes / transfer_rate,)

    def download(c: LayerCost) -> Cost:
        return () if transfer_rate is None else (c.grad_bytes / transfer_rate,)

    fwd_cost = [(c.forward_time, *upload(c)) for c in costs]
    bwd_cost = [(c.forward_time + c.backward_time, *upload(c), *download(c)) for c in costs]  # recompute + backward
    fused_cost = bwd_cost

    # The fused last stage: as long as it fits, and with several devices no more than their share.
    share = _part_cost(fused_cost, 0, n) / num_devices if num_devices > 1 else float("inf")
    start = n - 1
    if not fits_bwd(start, n):
        raise LayerTooLarge(f"the last layer alone does not fit in the device memory cap of {memory_cap} bytes")
    while start > 0 and fits_bwd(start - 1, n) and _part_cost(fused_cost, start - 1, n) <= share:
        start -= 1
    min_parts = max(num_devices - 1, 1)
    fwd_cuts = _partition(fwd_cost, fits_fwd, 0, start, min_parts)
    bwd_cuts = _partition(bwd_cost, fits_bwd, 0, start, min_parts)
    tail = [start] if start > 0 else []
    return ExecutePlan.from_cuts(n, fwd_cuts + tail, bwd_cuts + tail)

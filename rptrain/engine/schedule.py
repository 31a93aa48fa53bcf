"""Schedules: the list of jobs one call runs, as plain data (no torch).

A job is one stage on one device for all microbatches. Jobs form a chain: each consumes the
per-microbatch results of the job before it (activations going forward, gradients going
backward) and hands its own to the next. Backward jobs also read the inputs that forward jobs
saved at their checkpoints. Jobs go to devices round-robin in list order.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from .plan import ExecutePlan


class JobKind(enum.Enum):
    FORWARD = "forward"  # no graph; saves inputs at checkpoints when a backward follows
    FUSED = "fused"  # forward with graph, loss, backward: the last stage of a training call
    BACKWARD = "backward"  # recompute from checkpoints, then backward


@dataclass(frozen=True)
class Job:
    index: int
    kind: JobKind
    start: int  # first layer
    stop: int  # one past the last layer
    device: int
    checkpoints: tuple[int, ...] = ()  # FORWARD: layers whose input it saves; BACKWARD: recompute segment starts


def checkpoints_for(plan: ExecutePlan, grain: str, upto: int) -> tuple[int, ...]:
    """Layers before ``upto`` whose inputs a backward pass needs."""
    if grain == "layer":
        return tuple(range(upto))
    return tuple(a for a, _ in plan.backward if a < upto)


def _saves(start: int, stop: int, checkpoints: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(c for c in checkpoints if start <= c < stop)


def _assign(jobs: list[tuple], num_devices: int, first_device: int) -> tuple[Job, ...]:
    return tuple(Job(i, kind, a, b, (first_device + i) % num_devices, cps) for i, (kind, a, b, cps) in enumerate(jobs))


# Cached: every call of the same shape gets the same tuple, so the executor finds its lowering by identity.
@functools.lru_cache(maxsize=64)
def training_schedule(plan: ExecutePlan, num_devices: int, grain: str = "stage") -> tuple[Job, ...]:
    """forward_backward: forward stages, the fused last stage, backward stages in reverse."""
    fused_start, fused_stop = plan.forward[-1]
    checkpoints = checkpoints_for(plan, grain, fused_start)
    jobs = [(JobKind.FORWARD, a, b, _saves(a, b, checkpoints)) for a, b in plan.forward[:-1]]
    jobs.append((JobKind.FUSED, fused_start, fused_stop, ()))
    jobs += [(JobKind.BACKWARD, a, b, _saves(a, b, checkpoints)) for a, b in reversed(plan.backward[:-1])]
    return _assign(jobs, num_devices, 0)


@functools.lru_cache(maxsize=64)
def forward_schedule(plan: ExecutePlan, num_devices: int, save_for_backward: bool = False, grain: str = "stage") -> tuple[Job, ...]:
    """A plain forward call; with ``save_for_backward`` it keeps what ``backward_schedule`` needs."""
    checkpoints = checkpoints_for(plan, grain, plan.num_layers) if save_for_backward else ()
    jobs = [(JobKind.FORWARD, a, b, _saves(a, b, checkpoints)) for a, b in plan.forward]
    return _assign(jobs, num_devices, 0)


@functools.lru_cache(maxsize=64)
def backward_schedule(plan: ExecutePlan, num_devices: int, grain: str = "stage", first_device: int = 0) -> tuple[Job, ...]:
    """The backward of a recorded forward call: every backward stage recomputes, last stage first."""
    checkpoints = checkpoints_for(plan, grain, plan.num_layers)
    jobs = [(JobKind.BACKWARD, a, b, _saves(a, b, checkpoints)) for a, b in reversed(plan.backward)]
    return _assign(jobs, num_devices, first_device)

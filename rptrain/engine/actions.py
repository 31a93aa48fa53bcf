"""Lowering: a schedule (jobs) plus the engine's facts become every action of one call, per job.

A job's actions, in order: bring the stage's weights (``UPLOAD`` from the host, ``BIND`` a copy
already there: the host copy on a CPU, the resident copy on a GPU that keeps the model), ``PREFETCH``
the next job's weights on this device while this one computes, ``BUFFERS`` (BatchNorm statistics),
``START`` (the compute stream waits for those and gets zeroed gradient tensors), one compute action
per microbatch (``F`` forward, ``L`` forward + loss + backward, ``B`` recompute + backward), then
``SEND`` (gradients copied or added into the open window) or ``REDUCE`` (averaged across processes
first) and ``WRITEBACK`` (changed buffers home). Every decision the executor used to take per job
(prefetch, residency, CUDA graphs, activation offload, early gradient sends, buffer write-back) is
taken here, before the call, so ``RoundPipe.explain`` can print it and tests can assert it. The
executor only interprets the list. Pure Python: no torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .callpath import CallPath, decide
from .schedule import Job, JobKind


class Op(enum.Enum):
    UPLOAD = "UPLOAD"
    BIND = "BIND"
    PREFETCH = "PREFETCH"
    BUFFERS = "BUFFERS"
    START = "START"
    FORWARD = "F"
    FUSED = "L"
    BACKWARD = "B"
    CALL = "W"  # every microbatch's forward, loss and backward: one recorded graph (wholecall.py)
    SEND = "SEND"
    REDUCE = "REDUCE"
    WRITEBACK = "WRITEBACK"


_COMPUTE = {JobKind.FORWARD: Op.FORWARD, JobKind.FUSED: Op.FUSED, JobKind.BACKWARD: Op.BACKWARD}


@dataclass(frozen=True)
class Action:
    device: int
    op: Op
    job: int  # the stage's job index in the call ("s" in the printed form)
    micro: int = -1  # compute actions: the microbatch
    nbytes: int = 0  # transfers: bytes moved
    note: str = ""  # e.g. "graph", "early", "save>host", "resident"

    def __str__(self) -> str:
        parts = [f"d{self.device}", self.op.value, f"s{self.job}"]
        if self.micro >= 0:
            parts.append(f"m{self.micro}")
        if self.nbytes:
            parts.append(human_bytes(self.nbytes))
        if self.note:
            parts.append(self.note)
        return " ".join(parts)


def human_bytes(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{nbytes}B"


@dataclass(frozen=True)
class Facts:
    """What the lowering needs to know about the engine and the call."""

    cuda: bool  # the devices are GPUs (real or simulated)
    resident: bool  # the whole model stays on every GPU
    cuda_graphs: bool  # fused stages may be replayed as CUDA graphs
    max_graph_params: int
    reducer: bool  # gradients are averaged across processes
    num_microbatch: int
    profile: bool = False  # this call measures every layer (no graphs)
    offload: bool = False  # saved activations go to host memory
    whole_call: bool = False  # the engine may replay a whole call as one graph (callpath.py)


@dataclass(frozen=True)
class Sizes:
    """Bytes of one stage: weights (trainable + frozen), buffers, fp32-bound gradients, parameters."""

    weights: int
    buffers: int
    grads: int
    params: int


@dataclass(frozen=True)
class Lowered:
    """One job's actions and the decisions they encode."""

    job: Job
    actions: tuple[Action, ...]
    graphed: bool  # the fused stage replays CUDA graphs (static buffers and gradients)
    early: bool  # gradients leave during the last microbatch's backward
    offload: bool  # inputs saved at checkpoints go to host memory


def lower(jobs: Sequence[Job], facts: Facts, sizes: Callable[[int, int], Sizes]) -> list[Lowered]:
    """Every job's actions for one call."""
    following: dict[int, Job] = {}
    last_on: dict[int, Job] = {}
    for job in jobs:
        if job.device in last_on:
            following[last_on[job.device].index] = job
        last_on[job.device] = job
    streamed = facts.cuda and not facts.resident
    prefetched = {nxt.index for nxt in following.values()} if streamed else set()
    alone = len(jobs) == 1
    return [_lower_job(job, facts, sizes, following.get(job.index) if streamed else None, job.index in prefetched, alone) for job in jobs]


def lower_call(jobs: Sequence[Job], facts: Facts, sizes: Callable[[int, int], Sizes]) -> tuple[list[Lowered], CallPath]:
    """``lower`` and the call's path (callpath.py): on the whole-call path the fused job's compute
    actions become one ``W`` action covering every microbatch, its gradients sent after it."""
    lowered = lower(jobs, facts, sizes)
    path = decide(jobs, cuda=facts.cuda, whole_call=facts.whole_call, graphed=len(lowered) == 1 and lowered[0].graphed,
                  reducer=facts.reducer, profile=facts.profile, offload=facts.offload)
    if path.whole:
        item = lowered[0]
        compute = [a for a in item.actions if a.op is Op.FUSED]
        call = Action(compute[0].device, Op.CALL, compute[0].job, note=f"m0-{len(compute) - 1} whole-call graph")
        actions = [a for a in item.actions if a.op is not Op.FUSED]
        actions.insert(actions.index(next(a for a in actions if a.op is Op.START)) + 1, call)
        lowered = [Lowered(item.job, tuple(actions), item.graphed, False, item.offload)]
    return lowered, path


def _lower_job(job: Job, facts: Facts, sizes: Callable[[int, int], Sizes], prefetch: Optional[Job], was_prefetched: bool,
               alone: bool = False) -> Lowered:
    d, k, size = job.device, job.index, sizes(job.start, job.stop)
    # A training call's fused stage, or a call's only stage that is a forward saving nothing for a backward
    # (an evaluation under torch.no_grad: forward-only graphs, graphs.py).
    kind_graphs = job.kind is JobKind.FUSED or (job.kind is JobKind.FORWARD and alone and not job.checkpoints)
    graphed = (kind_graphs and facts.cuda_graphs and facts.resident and facts.cuda and not facts.profile
               and size.params <= facts.max_graph_params)
    has_grads = job.kind is not JobKind.FORWARD
    early = has_grads and not facts.reducer
    acts = []
    if facts.cuda and not facts.resident:
        acts.append(Action(d, Op.BIND, k, note="prefetched") if was_prefetched else Action(d, Op.UPLOAD, k, nbytes=size.weights))
    else:
        acts.append(Action(d, Op.BIND, k, note="resident" if facts.cuda else "host"))
    if prefetch is not None:
        acts.append(Action(d, Op.PREFETCH, prefetch.index, nbytes=sizes(prefetch.start, prefetch.stop).weights))
    scratch = "scratch" if job.kind is JobKind.BACKWARD else ("static" if graphed else "")
    acts.append(Action(d, Op.BUFFERS, k, nbytes=size.buffers if facts.cuda else 0, note=scratch))
    acts.append(Action(d, Op.START, k, note="graph" if graphed else ""))
    save = "save>host" if facts.offload and facts.cuda else "save"  # inputs at checkpoints
    for m in range(facts.num_microbatch):
        notes = ["graph"] if graphed else []
        if job.kind is JobKind.FORWARD and job.checkpoints:
            notes.append(save)
        if early and m == facts.num_microbatch - 1:
            notes.append("early-if-eager" if graphed else "early")
        acts.append(Action(d, _COMPUTE[job.kind], k, micro=m, note=" ".join(notes)))
    if has_grads:
        acts.append(Action(d, Op.REDUCE if facts.reducer else Op.SEND, k, nbytes=size.grads))
    if job.kind is not JobKind.BACKWARD and facts.cuda and size.buffers:
        acts.append(Action(d, Op.WRITEBACK, k, nbytes=size.buffers, note="if changed"))
    offload = facts.offload and facts.cuda and job.kind is JobKind.FORWARD and bool(job.checkpoints)
    return Lowered(job, tuple(acts), graphed, early, offload)


def by_device(lowered: Sequence[Lowered]) -> dict[int, list[Action]]:
    """Each device's actions in issue order (what ``explain`` prints)."""
    out: dict[int, list[Action]] = {}
    for item in lowered:
        out.setdefault(item.job.device, []).extend(item.actions)
    return out

"""Data parallelism across processes: average each job's gradients over a torch.distributed group.

Every rank runs the same plan, so the jobs with gradients come in the same order everywhere. The
collectives are issued in that order (a job waits for its turn when several device threads run),
asynchronously, so a stage's all-reduce overlaps the backward of the stages before it. NCCL
reduces GPU tensors on its own stream ordered after the download stream; gloo reduces host tensors
in its background threads. The engine finishes the copies into the fp32 gradient buffer when the
call's work is done.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class GradReducer:
    def __init__(self, group: Any):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self._turn = threading.Condition()
        self._next = 0
        self._pending: list[tuple[Any, Callable[[], None]]] = []

    def begin(self) -> None:
        with self._turn:
            self._next = 0
            self._pending = []

    def reduce(self, order: int, tensors: list[Tensor], then: Callable[[list[Tensor]], None], stopped: Callable[[], bool]) -> None:
        """Average ``tensors`` (the ``order``-th reducing job of the call), then hand the averaged
        tensors to ``then``: at once for NCCL (stream-ordered), after the collective for gloo."""
        with self._turn:
            while self._next != order:
                if stopped():
                    return
                self._turn.wait(timeout=0.5)
            if self.backend == "nccl":
                # One communicator per process: a job that ran on another local GPU first moves its
                # gradients (a peer copy) to the GPU the group was set up on.
                home = torch.device("cuda", torch.cuda.current_device())
                tensors = [t if t.device == home else t.to(home, non_blocking=True) for t in tensors]
                for t in tensors:
                    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.group, async_op=True).wait()
                then(tensors)
            else:  # gloo has no AVG: scale first, then sum
                for t in tensors:
                    t.div_(self.world)
                    self._pending.append((dist.all_reduce(t, group=self.group, async_op=True), None))
                self._pending.append((None, lambda: then(tensors)))
            self._next += 1
            self._turn.notify_all()

    def finish(self) -> None:
        """Wait for the collectives and run what waited on them, in order."""
        for work, then in self._pending:
            if work is not None:
                work.wait()
            if then is not None:
                then()
        self._pending = []

    def any_flag(self, flag: bool, device: torch.device) -> bool:
        """True if ``flag`` is true on any rank (e.g. inf/NaN gradients: every rank must skip)."""
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def check_same(self, master: Tensor, device: torch.device) -> None:
        """Ranks must start from the same weights: compare a fingerprint instead of moving them."""
        sample = master[:: max(1, master.numel() // 100_000)].double()
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64)
        fingerprint = torch.stack([(sample * weights).sum(), sample.abs().sum()]).to(device)
        low, high = fingerprint.clone(), fingerprint.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(low, high):
            raise RuntimeError(
                "data-parallel ranks start from different weights: seed every rank the same way or load the same checkpoint"
            )

    def broadcast_object(self, obj: Optional[Any]) -> Any:
        """Rank 0's ``obj`` on every rank (plans must be identical: the collectives follow them)."""
        holder = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(self.group, 0), group=self.group)
        return holder[0]


def make_reducer(process_group: Any) -> Optional["GradReducer"]:
    """The data-parallel reducer over ``process_group``, or None without one."""
    return None if process_group is None else GradReducer(process_group)

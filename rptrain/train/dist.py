"""Several processes (torchrun, srun torchrun): one process group and the trainer's own collectives.

Every process runs the same `rptrain ...` command. Each builds the same model from the same seed,
reads its shard of every global batch, and the engine averages the gradients over the group
before each optimizer step. Around that the trainer needs a few small exchanges, each done by
every rank at the same point of the loop: when to stop (a signal may reach the ranks at different
steps), the global loss count, averaged metrics, rank 0's choice of checkpoint, a weight check
at checkpoints, a barrier before leaving after a stop. A collective that fails because a peer died or hung becomes a PeerError, one line;
dist.timeout_s bounds how long a hung peer can stall the others.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from .errors import ConfigError, one_line


class PeerError(RuntimeError):
    """A collective failed: another rank died, hung past dist.timeout_s, or the network broke."""


class NothingToDo(Exception):
    """Rank 0 found nothing to run (the run is complete): the other ranks exit 0 with it."""


class FailedOnRankZero(Exception):
    """Rank 0 hit an error that it reports itself; the other ranks exit with code 2, quietly."""


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ConfigError(f"{name}={value!r} in the environment is not an integer: launch with torchrun, or unset it") from None


def world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return max(env_int("WORLD_SIZE", 1), 1)


def rank() -> int:
    return env_int("RANK", 0) if world_size() > 1 else 0


def local_rank() -> int:
    return env_int("LOCAL_RANK", 0) if world_size() > 1 else 0


def other_rank() -> bool:
    """A rank other than 0 of several (False when the environment cannot tell)."""
    try:
        return rank() > 0
    except ConfigError:
        return False


def rank_prefix() -> str:
    """"rank N: " under torchrun, where the ranks' output interleaves; "" for one process."""
    try:
        return f"rank {rank()}: " if world_size() > 1 else ""
    except ConfigError:
        return ""


def say(line: str) -> None:
    """``line`` on stderr in one write. print() writes the text and its newline separately, so two ranks
    printing at once could share a line ("rank 0: ...rank 1: ...", then two newlines; seen in CI)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@dataclass
class Dist:
    """This process's place in the group; with world == 1 every method is a no-op.

    The trainer's own collectives are tiny and go through `control`, a gloo group on the CPU: the
    whole group under gloo, a second one beside NCCL, so that they never wait on a GPU stream."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    devices: Optional[list[str]] = None  # the engine's devices; None: its default (every GPU, else the CPU)
    control: Any = None

    @property
    def group(self) -> Any:
        """The engine's group: gradients are averaged over it."""
        return dist.group.WORLD if self.world > 1 else None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float], what: str) -> list[float]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        with peer_errors(what):
            dist.all_reduce(t, group=self.control)
        return t.tolist()

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        holder = [obj if self.main else None]
        with peer_errors(what):
            dist.broadcast_object_list(holder, src=0, group=self.control)
        return holder[0]

    def barrier(self, what: str) -> None:
        if self.world > 1:
            with peer_errors(what):
                dist.barrier(group=self.control)

    def check_same(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        """Raise if the ranks hold different `tensors` (their sums and L1 norms, compared in float64)."""
        if self.world == 1:
            return
        local = []
        for t in tensors.values():
            if t.is_floating_point():
                local += [float(torch.sum(t, dtype=torch.float64)), float(torch.linalg.vector_norm(t, 1, dtype=torch.float64))]
        low = torch.tensor(local, dtype=torch.float64)
        high = low.clone()
        with peer_errors(f"the comparison of {what}"):
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.control)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.control)
        if not torch.equal(low, high):
            raise RuntimeError(f"the {self.world} ranks hold different {what}: data-parallel training went out of step (a bug: please report it)")


_ACTIVE: Optional[Dist] = None


def setup(cfg: DictConfig) -> Dist:
    """Join torchrun's process group: once per process (the jobs of a sweep share it). Raises NothingToDo on
    the other ranks when rank 0 found nothing to run (end_before_start)."""
    global _ACTIVE
    if world_size() == 1:
        return Dist()
    if _ACTIVE is not None:
        return _ACTIVE
    _ACTIVE = _join(cfg)
    verdict = _ACTIVE.broadcast(None, "the start (rank 0 failed its checks or never started)")
    if verdict is not None:
        raise NothingToDo(verdict)
    # Every rank has passed the checks before training (and local rank 0 has downloaded the data).
    _ACTIVE.barrier("the start (a rank failed its checks or never started)")
    return _ACTIVE


def end_before_start(cfg: DictConfig, message: str) -> None:
    """Rank 0 ends without training (trainer.resume=auto found the run complete). It still meets the other
    ranks, which are joining the group to train: they learn there is nothing to do and exit 0 with it. Without
    this they would wait dist.timeout_s for rank 0 and fail, while torchrun waits for them."""
    if world_size() == 1 or rank() != 0:
        return
    group = _join(cfg)
    group.broadcast(message, "the start (telling the other ranks there is nothing to do)")
    shutdown()


def _join(cfg: DictConfig) -> Dist:
    rank_, local, local_world = rank(), local_rank(), max(env_int("LOCAL_WORLD_SIZE", 1), 1)
    backend = cfg.backend.value
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    devices = local_devices(local, local_world)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(devices[0] if devices else "cuda:0"))  # NCCL works on the current device
    timeout = datetime.timedelta(seconds=float(cfg.timeout_s))
    with peer_errors("joining the process group"):
        dist.init_process_group(backend, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return Dist(rank_, world_size(), local, devices, control)


def local_devices(local: int, local_world: int) -> Optional[list[str]]:
    """This process's GPUs: all of the machine's when torchrun starts one process per machine
    (--nproc-per-node 1, one engine over every GPU), else an equal share (one GPU each with
    --nproc-per-node = the number of GPUs). None without CUDA: the engine runs on the CPU."""
    if not torch.cuda.is_available() or local_world == 1:
        return None
    n = torch.cuda.device_count()
    if n == 1:  # each process sees its own GPU (torchrun --virtual-local-rank, a scheduler's binding)
        return None
    if n % local_world:
        raise ConfigError(
            f"{n} GPUs do not split evenly over the {local_world} processes torchrun starts on this machine: "
            f"use --nproc-per-node 1 (one engine over all its GPUs) or a divisor of {n}"
        )
    share = n // local_world
    return [f"cuda:{i}" for i in range(local * share, (local + 1) * share)]


def shutdown() -> None:
    """Leave the group after a run that ended normally (after a failed collective, destroying
    an NCCL group can hang: the process exit cleans up instead)."""
    global _ACTIVE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _ACTIVE = None


# ----------------------------------------------------------------------------- failures
_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out", "timeout")


def is_peer_failure(err: Optional[BaseException]) -> bool:
    """Does `err` (or what caused it) come from a collective whose peer went away?"""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, PeerError) or (dist.is_available() and isinstance(err, dist.DistError)):
            return True
        if any(m in str(err).lower() for m in _MARKERS):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def peer_errors(what: str, active: bool = True) -> Iterator[None]:
    """Turn a failed collective inside the block into a one-line PeerError naming `what`."""
    try:
        yield
    except PeerError:
        raise
    except Exception as err:
        if not active or not is_peer_failure(err):
            raise
        raise PeerError(f"a peer rank failed or timed out during {what} ({_gist(err)}): see the other ranks' output") from err


def _gist(err: BaseException) -> str:
    """`[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:1411. This is
    typically...` -> `Connection closed by peer [10.0.0.2]:1411`."""
    text = one_line(next((line for line in str(err).splitlines() if line.strip()), "") or type(err).__name__)
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". ")[0][:200]

"""How many threads a run's CPU work gets: PyTorch's intra-op pool and the optimizer step.

PyTorch starts one intra-op (OpenMP) thread per core and those threads spin while they wait for
work. On a CPU another process is using, that spinning competes with the other process and with
the engine's optimizer thread: the README's CPU example took 194-234 s with one core busy elsewhere
against 17 s with OMP_NUM_THREADS=1 (2 cores, issue #32). So a run takes the cores that are free:

    cores   the CPUs this process may run on (os.sched_getaffinity: taskset, cgroups' cpusets, SLURM)
    busy    the 1-minute load average (runnable processes, system-wide), scaled to those cores
    free    cores - busy, rounded, split between torchrun's processes on this machine, at least 1

The load average is what other processes ran over the last minute, read before this run adds its
own (start-up counts for a few seconds of it at most): no measurement run that would cost the start
a second and itself disturb what it measures. OMP_NUM_THREADS or engine.threads choose by hand.
On GPU engines the optimizer step gets one thread fewer than the intra-op pool (the engine's
default; engine.optimizer_threads), leaving one to the thread that issues GPU work; on a CPU it
runs inline, on the intra-op pool.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def free_cores() -> tuple[int, int, float]:
    """(cores this process may use, of them free, the load average scaled to them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0] * cores / (os.cpu_count() or cores)
    except OSError:  # no load average on this system
        load = 0.0
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))  # torchrun's processes on this machine share them
    return cores, max(1, min(cores, round(cores - load)) // ranks), load


def choose_threads(setting: Optional[int]) -> tuple[int, str]:
    """(intra-op threads, why): engine.threads, else OMP_NUM_THREADS's (torch read it), else the free cores."""
    if setting is not None:
        return setting, "engine.threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    cores, free, load = free_cores()
    return free, f"{cores} cores allowed, load {load:.1f} from other processes: {free} free; engine.threads=N to choose"


def set_threads(setting: Optional[int], optimizer_threads: Optional[int], cuda: bool) -> str:
    """Set the intra-op pool; the line that says what the run uses and why."""
    threads, why = choose_threads(setting)
    torch.set_num_threads(threads)
    if not cuda:
        step = "the optimizer step runs inline on them"
    else:
        step = f"optimizer step {optimizer_threads or max(1, threads - 1)} threads"
    return f"CPU threads: {threads} intra-op ({why}); {step}"

"""Shared helpers for the benchmarks: one JSON line per measurement, honest clocks."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any, Callable

import torch


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemAvailable: what a new allocation can take without swapping or the OOM killer)."""
    with open("/proc/meminfo") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)}


def emit(**fields: Any) -> None:
    print(json.dumps(fields, sort_keys=False), flush=True)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="CI size: checks the script runs, measures nothing useful")
    return p


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Callable[[int], Any], steps: int, warmup: int, device: str, finish: Callable[[], Any] = lambda: None) -> float:
    """Seconds per step over ``steps`` after ``warmup``; the clock stops after a device sync."""
    for i in range(warmup):
        step(i)
    finish()
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    finish()
    sync(device)
    return (time.perf_counter() - start) / steps


def die(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def high_water() -> int:
    """This process's own peak resident bytes (VmHWM). getrusage's ru_maxrss is not used for differences: it
    can carry the size of the process that spawned this one, which hides any growth below that size."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def kernel_times(step: Callable[[int], Any], device: str, steps: int = 3, top: int = 12,
                 finish: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """Where a step's device time goes, from one profiler run of ``steps`` steps: the costliest kernels (CPU
    ops on a CPU) as [name, milliseconds per step, calls per step], every kernel's time per step summed
    (``busy_ms``; streams that overlap count twice) and the wall time per step under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    start = time.perf_counter()
    with profile(activities=[activity]) as prof:
        for i in range(steps):
            step(i)
        finish()
        sync(device)
    wall = (time.perf_counter() - start) / steps
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    return dict(wall_ms=round(wall * 1e3, 2), busy_ms=round(sum(getattr(e, attr) for e in events) / 1e3 / steps, 2),
                top=[[e.key[:80], round(getattr(e, attr) / 1e3 / steps, 3), e.count // steps] for e in events[:top]])

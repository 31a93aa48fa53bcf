"""The CLI's image input pipeline (data.pipeline=tensor): host time per batch, with the GPU idle and
with the GPU busy on a queued stand-in for the engine's step.

The engine's call ends when the step's GPU work is done, so whatever host time a batch takes is
GPU idle time unless the loader prepares it ahead (``--prefetch``). Reported per configuration:
host milliseconds to hand out one batch, and the whole loop's milliseconds per batch.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from common import emit, parser, sync
from rptrain.data import BatchAugment, BatchLoader


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--images", type=int, default=50_000)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--busy-ms", type=float, default=12.0, help="GPU work queued per batch, standing in for the engine's step")
    p.add_argument("--cprofile", action="store_true", help="the host's top functions per batch, on stderr")
    args = p.parse_args()
    if args.tiny or args.device == "cpu":
        args.images, args.batches, args.batch, args.busy_ms = 512, 6, 32, 0.0
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.images, 3, 32, 32), dtype=torch.uint8, generator=g).to(dev)
    labels = torch.randint(0, 100, (args.images,), generator=g).to(dev)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    busy = busy_work(dev, args.busy_ms)
    for prefetch in (False, True):
        loader = BatchLoader((images, labels), args.batch, transform=BatchAugment((0.5,) * 3, (0.25,) * 3, out_dtype=dtype), prefetch=prefetch)
        for label, work in (("idle", None), ("busy", busy)):
            host, per_batch = run(loader, args.batches, work, dev)
            emit(bench="data", device=args.device, batch=args.batch, prefetch=prefetch, gpu=label, busy_ms=args.busy_ms if work else 0.0,
                 host_ms_per_batch=round(1e3 * host, 3), loop_ms_per_batch=round(1e3 * per_batch, 3))
    if args.cprofile:
        loader = BatchLoader((images, labels), args.batch, transform=BatchAugment((0.5,) * 3, (0.25,) * 3, out_dtype=dtype))
        prof = cProfile.Profile()
        prof.enable()
        run(loader, args.batches, None, dev)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue(), file=sys.stderr)


def busy_work(dev: torch.device, ms: float):
    """A closure queueing about ``ms`` of GPU work and waiting for it, as the engine's call does."""
    if dev.type != "cuda" or ms <= 0:
        return None
    a = torch.randn(4096, 4096, device=dev, dtype=torch.float16)
    sync("cuda")
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    sync("cuda")
    repeats = max(1, round(ms / (1e3 * (time.perf_counter() - start) / 20)))

    def work() -> None:
        for _ in range(repeats):
            a @ a
        torch.cuda.current_stream(dev).synchronize()

    return work


def run(loader: BatchLoader, batches: int, work, dev: torch.device) -> tuple[float, float]:
    """(host seconds spent inside the loader per batch, wall seconds per loop iteration)."""
    host = 0.0
    source = loader.epoch(0)
    for _ in range(3):  # warm-up: lazy initialisation, the pinned-memory cache
        next(source)
    sync(dev.type)
    start = time.perf_counter()
    for _ in range(batches):
        t0 = time.perf_counter()
        x, y = next(source)
        host += time.perf_counter() - t0
        if work is not None:
            work()
    sync(dev.type)
    wall = time.perf_counter() - start
    source.close()
    return host / batches, wall / batches


if __name__ == "__main__":
    main()

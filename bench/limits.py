"""Physical limits of this machine: pinned host<->device copy bandwidth and bf16 matmul rate."""
from __future__ import annotations

import torch

from common import emit, parser


def main() -> None:
    args = parser(__doc__).parse_args()
    if args.device != "cuda":
        emit(bench="limits", device="cpu", skipped="no CUDA device")
        return
    nbytes = (64 << 20) if args.tiny else (2 << 30)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)), ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        stop.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(stop) / 1000 / 5
        emit(bench="limits", what=f"pinned_{name}", gbytes_per_s=round(nbytes / seconds / 1e9, 2))
    n = 1024 if args.tiny else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1000 / 10
    emit(bench="limits", what="bf16_matmul", n=n, tflops=round(2 * n**3 / seconds / 1e12, 1))


if __name__ == "__main__":
    main()

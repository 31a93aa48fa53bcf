"""Issue 29: writing and loading a big checkpoint. A model-shaped state (fp32 master and two fp32 moments
per layer, a share of the master on the GPU with --gpu-share) is saved with the default shards and
writers, and with one shard and one writer (the previous single-stream write); each in its own process
(peak RSS is per process). Prints seconds, GB/s and the peak RSS growth of the write, and the load +
checksum verification time.

    python3 bench/checkpoint_io.py --gib 16 --dir /tmp/ckpt      # on the GPU machine (~1 min)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit, high_water, parser  # noqa: E402

from rptrain.train import checkpoint as ckpt  # noqa: E402
from rptrain.train import checkpoint_layout as layout  # noqa: E402


def state_of(gib: float, layers: int, device: str, gpu_share: float) -> dict:
    per = int(gib * 2**30 / 12 / layers)  # elements per layer: master + two moments, fp32
    on_gpu = int(layers * gpu_share) if device == "cuda" else 0
    master = {f"layer{i}.w": torch.randn(per, device="cuda" if i < on_gpu else "cpu") for i in range(layers)}
    moments = {i: {"exp_avg": torch.randn(per), "exp_avg_sq": torch.rand(per)} for i in range(layers)}
    return {"model": master, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-4}]}, "step": 1}


def one(args) -> None:
    """In this process: one write (mode) and one load."""
    if args.mode == "one-stream":
        layout.WRITERS, layout.SHARD_BYTES = 1, 2**62
    state = state_of(args.gib, args.layers, args.device, args.gpu_share)
    nbytes = ckpt.state_nbytes(state) - 2**20
    directory = Path(args.dir) / args.mode
    shutil.rmtree(directory, ignore_errors=True)
    before = high_water()
    start = time.perf_counter()
    ckpt.save_checkpoint(directory / "step-00000001.pt", state)
    save_s = time.perf_counter() - start
    grew = high_water() - before
    shards = len(layout.shard_files(directory / "step-00000001.pt"))
    del state
    start = time.perf_counter()
    ckpt.load_checkpoint(directory / "step-00000001.pt")
    load_s = time.perf_counter() - start
    shutil.rmtree(directory, ignore_errors=True)
    emit(bench="checkpoint_io", mode=args.mode, device=args.device, gib=round(nbytes / 2**30, 3), shards=shards,
         writers=layout.WRITERS, save_s=round(save_s, 3), save_gb_s=round(nbytes / save_s / 1e9, 3),
         save_rss_growth_mib=round(grew / 2**20, 1), load_verify_s=round(load_s, 3), cpus=os.cpu_count())


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--gib", type=float, default=8.0, help="the state's size")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--gpu-share", type=float, default=0.25, help="share of the master's layers on the GPU (cuda)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder in the working directory)")
    p.add_argument("--mode", choices=["sharded", "one-stream"], default=None, help="one measurement in this process")
    args = p.parse_args()
    if args.tiny:
        args.gib, args.layers = 0.01, 4
    if args.mode is not None:
        return one(args)
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as where:
        for mode in ("sharded", "one-stream"):
            cmd = [sys.executable, __file__, "--device", args.device, "--gib", str(args.gib), "--layers", str(args.layers),
                   "--gpu-share", str(args.gpu_share), "--dir", where, "--mode", mode]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                emit(bench="checkpoint_io", mode=mode, error=out.stderr.strip().splitlines()[-1:])
                continue
            for line in out.stdout.splitlines():
                emit(**json.loads(line))


if __name__ == "__main__":
    main()

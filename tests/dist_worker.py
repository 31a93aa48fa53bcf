"""A data-parallel training run for tests/test_dist.py, launched by torchrun (gloo on CPU, or
NCCL on GPUs).

Usage: torchrun --standalone --nproc-per-node N tests/dist_worker.py OUT_DIR [--die-at STEP]
       [--backend nccl --gpu-workers K]
Each rank trains on its shard of every global batch and writes its final weights to OUT_DIR.
With NCCL each rank's engine runs K device workers on its local GPU.
"""
import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.optim import Adam
from rptrain.engine.simulated import SimulatedDevice

GLOBAL_BATCH, STEPS = 8, 3


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def train(engine, opt, data, rank, world, die_at=None):
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=ExecutePlan.from_cuts(5, [2], [2]))
    for step, (x, y) in enumerate(data):
        if die_at is not None and step == die_at and rank == 1:
            print("rank 1 dies on purpose", flush=True)
            os._exit(3)  # simulates a crashed node: no cleanup, no collective
        local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        # The mean over the global batch: each rank's share of it, microbatches summed.
        engine.forward_backward(input_args=(x[local],), label=y[local], run_config=cfg,
                                loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, reduction="sum") * world / GLOBAL_BATCH)
        engine.step(lambda: (opt.step(), opt.zero_grad()))
    engine.synchronize()


def gpu_devices(workers: int) -> list[str]:
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    return [f"cuda:{local}"] * workers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--gpu-workers", type=int, default=1)
    p.add_argument("--simulated", action="store_true", help="gloo with a SimulatedDevice: the GPU share's paths on the CPU")
    args = p.parse_args()
    devices = gpu_devices(args.gpu_workers) if args.backend == "nccl" else [SimulatedDevice(0)] if args.simulated else ["cpu"]
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = RoundPipe(model(), process_group=dist.group.WORLD, devices=devices)
    assert not args.simulated or engine._host.gpu is not None  # master and gradients on the (simulated) GPU
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    try:
        train(engine, opt, batches(), rank, world, args.die_at)
    except Exception as e:  # a peer died: say so in one line and fail
        print(f"rank {rank}: training stopped: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        sys.exit(1)
    torch.save(engine.state_dict(), os.path.join(args.out, f"rank{rank}.pt"))
    engine.close()
    dist.destroy_process_group()
    # The work is written; skip the interpreter's teardown. After a training run the gloo group's Python
    # object outlives destroy_process_group() (held from C++: no Python referrer; not so when the engine
    # only was built), and about one exit in twenty then aborted in the teardown ("terminate called without
    # an active exception", SIGABRT), failing the launch after both ranks had saved their weights.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""Issue 33: how long the training thread waits while a background checkpoint is written.

The CLI writes a small state's checkpoint on a thread while training goes on (run_checkpoints.py). The
training thread spends much of a step blocked on the GPU with the GIL released; when it wakes, it needs the
GIL back, and waits as long as the writer holds it. This writes the main job's state (ResNet-34's fp32
weights and Adam moments, 20 epochs of metrics history) with ``save_rotating`` on a thread, several times into
one directory as the CLI does, while this thread sleeps 1 ms at a time (as it would block on the GPU), and
prints how late it woke beyond a run without a write: the total per save, the longest wait, the waits over
1 ms. ``--switch-ms``: the interpreter's GIL switch interval (Python's default 5 ms).

    python3 bench/checkpoint_gil.py --saves 4
"""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit, parser  # noqa: E402

from rptrain.train import checkpoint as ckpt  # noqa: E402


def main_job_state(tiny: bool) -> dict:
    """What run_checkpoints.save writes for the main job, in shape: weights, Adam's state, the metrics history."""
    model = torchvision.models.resnet18(num_classes=10) if tiny else torchvision.models.resnet34(num_classes=100)
    params = list(model.parameters())
    optimizer = {"state": {i: {"step": torch.tensor(100.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                           for i, p in enumerate(params)},
                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(len(params)))}]}
    history = []
    for epoch in range(20):  # the main job's 20 epochs of 16 log windows and an evaluation
        history += [{"kind": "train", "step": epoch * 391 + w * 25, "epoch": epoch, "loss": 1.2345678, "acc": 0.5, "lr": 1e-3,
                     "samples_per_s": 37000.5, "data_time": 1e-5, "step_time": 3.6e-3, "step_wall_time": 3.6e-3, "time": 12.5}
                    for w in range(16)]
        history.append({"kind": "eval", "step": epoch * 391, "epoch": epoch, "test_loss": 1.1, "test_acc": 0.6, "eval_time": 0.08})
    return {"fingerprint": {"model": "resnet34"}, "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer, "scheduler": {"last_epoch": 5}, "scaler": {}, "loader": {"epoch": 3}, "rng": ckpt.rng_state(),
            "progress": {"step": 100}, "history": history, "config": {"model": {"name": "resnet34"}}, "overrides": []}


def lateness(until: threading.Event | float) -> list[float]:
    """Sleep 1 ms at a time until the event is set (or for that many seconds): each wake's delay beyond 1 ms."""
    late, start = [], time.perf_counter()
    while not (until.is_set() if isinstance(until, threading.Event) else time.perf_counter() - start > until):
        t = time.perf_counter()
        time.sleep(1e-3)
        late.append(time.perf_counter() - t - 1e-3)
    return late


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--switch-ms", type=float, help="sys.setswitchinterval for this process")
    args = p.parse_args()
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1e3)
    state = main_job_state(args.tiny)
    control = lateness(0.5)
    base = sum(control) / len(control)  # a sleep's own overshoot
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(2 if args.tiny else args.saves):
            done = threading.Event()
            writer = threading.Thread(target=lambda: (ckpt.save_rotating(Path(tmp), state, k, keep=2), done.set()))
            start = time.perf_counter()
            writer.start()
            late = lateness(done)
            writer.join()
            emit(bench="checkpoint_gil", save=k, write_ms=round(1e3 * (time.perf_counter() - start), 1), wakes=len(late),
                 waited_ms=round(1e3 * sum(max(0.0, x - base) for x in late), 1), longest_ms=round(1e3 * max(late), 2),
                 over_1ms=sum(x > 1e-3 for x in late), switch_ms=1e3 * sys.getswitchinterval(),
                 control_overshoot_ms=round(1e3 * base, 3))


if __name__ == "__main__":
    main()

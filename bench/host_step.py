"""Issue 22: the host (Python) time of a training step, on the CPU, where compute is negligible.

A ResNet-34-shaped model four channels wide on 4x4 images, on a simulated GPU
(rptrain/engine/simulated.py: resident weights, the graph bookkeeping, gradient sends, as on a GPU)
whose CUDA graphs are recorded once eagerly and then "replay" as a no-op: the replay's host path
(engine/graphs.py's _Replay: input copies, output views, gradient copies) runs, the stage's
compute does not. What is left of a step is its Python work plus a tiny loss, gradient copy and
Adam. With a GradScaler, as the CLI trains on a GPU, two loops run the same engine:
- engine: the bare loop of bench/resnet.py (forward_backward with return_outputs, engine.step,
  scaler.update, the loss and accuracy summed on the device and read every --log-interval steps);
- cli: the CLI's loop (rptrain/train/loop.py, in process), the mean interval between steps over
  the steady part of one epoch, log steps included, data fetch included.
Per loop: step_us (wall), main_thread_cpu_us, loop_cpu_us (the loop's own part: outside the
engine's calls) and gpu_idle_us (Gaps); cli_minus_engine_us is what the CLI adds. Always on the
CPU (--device is ignored). --profile prints each loop's functions by self time per step
(cProfile; on Python 3.12+ it sees the optimizer thread too).
"""
from __future__ import annotations

import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from common import emit, parser
from rptrain import GradScaler, OptimizerCtx, RoundPipe
from rptrain.engine import graphs
from rptrain.engine.simulated import SimulatedDevice
from rptrain.models import build_model
from rptrain.optim import Adam

WIDTHS = dict(widths=(4, 4, 4, 4), stem_channels=4)


class EngineClock:
    """The issuing thread's CPU time inside RoundPipe.forward_backward and RoundPipe.step: the
    rest of a step's CPU time is the loop's own work (data, loss bookkeeping, metrics, logging)."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.originals = {name: getattr(RoundPipe, name) for name in ("forward_backward", "step")}

    def __enter__(self) -> "EngineClock":
        for name, original in self.originals.items():
            setattr(RoundPipe, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(RoundPipe, name, original)

    def _timed(self, original):
        def call(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.cpu += time.thread_time() - start
        return call


class Gaps:
    """On a GPU the device has nothing queued from the end of one call's final wait for it until the
    next call's first graph replay: the issuing thread's work in between (the engine's tail and
    prologue, the loop's own work) is time the GPU idles. Summed here over a loop's timed steps."""

    def __init__(self) -> None:
        self.synced: float | None = None  # when the last call's device wait returned
        self.idle = 0.0

    def call_done(self) -> None:
        self.synced = time.perf_counter()

    def replay(self) -> None:
        if self.synced is not None:
            self.idle += time.perf_counter() - self.synced
        self.synced = None


GAPS = Gaps()


class _NoGraph:
    def replay(self) -> None:
        pass


class NullGraphs(graphs.StageGraphs):
    """StageGraphs whose capture runs the stage eagerly once (the static outputs and input
    gradients exist) and whose graphs replay nothing: the replay's host cost without its compute."""

    def _record(self, modules, x, call, grad=True):  # a forward-only recording (grad=False) is faked the same way
        leaves, spec = pytree.tree_flatten(x)
        inputs = [v.detach().clone().requires_grad_(v.requires_grad) for v in leaves]
        with torch.enable_grad():
            out = pytree.tree_unflatten(inputs, spec)
            for layer in modules:
                out = call(layer, out)
            out_leaves, out_spec = pytree.tree_flatten(out)
            wanted = [i for i, v in enumerate(out_leaves) if v.requires_grad]
            grad_outputs = [torch.zeros_like(out_leaves[i]) for i in wanted]
            torch.autograd.backward([out_leaves[i] for i in wanted], grad_outputs)
        self._anchor = torch.zeros((), requires_grad=True)
        return graphs._Recorded(_NoGraph(), _NoGraph(), inputs, [o.detach() for o in out_leaves], wanted, grad_outputs,
                                out_spec, [None] * len(out_leaves))

    def _replay(self, rec, modules, x, call):
        GAPS.replay()
        return super()._replay(rec, modules, x, call)


class Device(SimulatedDevice):
    def graphs(self, tuning):
        return NullGraphs(self.torch_device, tuning)

    def synchronize(self) -> None:  # the wait at the end of every call
        super().synchronize()
        GAPS.call_done()


def engine_loop(args) -> tuple[dict, cProfile.Profile | None]:
    """bench/resnet.py's engine step on the simulated GPU: microseconds per step (_per_step)."""
    torch.manual_seed(0)
    model = RoundPipe(build_model("resnet34", num_classes=10, **WIDTHS), optim_dtype=torch.float32, devices=[Device(0)])
    with OptimizerCtx():
        optimizer = Adam(model.parameters())
    scaler, criterion = GradScaler(), nn.CrossEntropyLoss()
    data = [(torch.randn(args.batch, 3, args.size, args.size), torch.randint(0, 10, (args.batch,))) for _ in range(4)]
    sums = [0, 0]

    def optimizer_step() -> None:
        scaler.step(optimizer)
        optimizer.zero_grad()

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        loss, out = model.forward_backward(input_args=(x,), label=y, return_outputs=True,
                                           loss_fn=lambda o, lab: scaler.scale(criterion(o.float(), lab)) / 2)
        model.step(optimizer_step)
        scaler.update()
        sums[0] = sums[0] + loss.detach()
        sums[1] = sums[1] + out.argmax(1).eq(y).sum()
        if (i + 1) % args.log_interval == 0:
            float(sums[0]), float(sums[1])
            sums[0] = sums[1] = 0

    for i in range(args.warmup):
        step(i)
    model.wait_for_steps()
    prof = cProfile.Profile() if args.profile else None
    start, cpu, idle = time.perf_counter(), time.thread_time(), GAPS.idle
    with prof or _nothing(), EngineClock() as clock:
        for i in range(args.steps):
            step(args.warmup + i)
        model.wait_for_steps()
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    model.close()
    return _per_step(args.steps, seconds, cpu, clock.cpu, GAPS.idle - idle), prof


def cli_loop(args) -> tuple[dict, cProfile.Profile | None]:
    """The CLI's loop on the simulated GPU, over the epoch's steady steps (_per_step)."""
    from hydra import compose, initialize_config_module
    from rich.console import Console

    from rptrain.train import schema, setup
    from rptrain.train.loop import Trainer
    from rptrain.train.signals import StopRequest

    steps = args.warmup + args.steps + args.warmup  # steady steps in the middle: the epoch's end evaluates
    schema.register_configs()
    overrides = ["model=resnet34", *(f"model.{k}={list(v) if isinstance(v, tuple) else v}".replace(" ", "") for k, v in WIDTHS.items()),
                 "data=synthetic", f"data.num_train={steps * args.batch}", "data.num_test=16", "data.num_classes=10",
                 f"data.image_size={args.size}", f"trainer.batch_size={args.batch}", "trainer.epochs=1",
                 f"trainer.log_interval={args.log_interval}", "trainer.progress=false", "trainer.hf_export=false",
                 "precision=fp16", "precision.compute_dtype=float32", "run_config.num_microbatch=2", *args.cli]
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    marks: list[tuple[float, float, float]] = []
    clock = EngineClock()
    prof = cProfile.Profile() if args.profile else None
    engine_class, after_step = setup.RoundPipe, Trainer._after_step

    def simulated(*a, **kw):
        return engine_class(*a, **{**kw, "devices": [Device(0)]})

    def marked(self, *a, **kw):
        marks.append((time.perf_counter(), time.thread_time(), clock.cpu, GAPS.idle))
        if prof is not None and len(marks) == args.warmup:
            prof.enable()
        if prof is not None and len(marks) == args.warmup + args.steps:
            prof.disable()
        return after_step(self, *a, **kw)

    setup.RoundPipe, Trainer._after_step = simulated, marked
    try:
        with tempfile.TemporaryDirectory() as tmp, clock:
            summary = Trainer(cfg, Path(tmp), overrides, Console(quiet=True), "").fit(StopRequest())
    finally:
        setup.RoundPipe, Trainer._after_step = engine_class, after_step
    (wall0, cpu0, inside0, idle0), (wall1, cpu1, inside1, idle1) = marks[args.warmup - 1], marks[args.warmup + args.steps - 1]
    assert summary["steps"] == steps
    return _per_step(args.steps, wall1 - wall0, cpu1 - cpu0, inside1 - inside0, idle1 - idle0), prof


def _per_step(steps: int, wall: float, cpu: float, engine_cpu: float, idle: float) -> dict:
    """µs per step: wall clock; the issuing thread's CPU time; of it, outside the engine's calls (the
    loop's own); the wall time between calls a GPU would idle (Gaps)."""
    return dict(step_us=round(wall / steps * 1e6, 1), main_thread_cpu_us=round(cpu / steps * 1e6, 1),
                loop_cpu_us=round((cpu - engine_cpu) / steps * 1e6, 1), gpu_idle_us=round(idle / steps * 1e6, 1))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def top(prof: cProfile.Profile, loop: str, steps: int, count: int) -> None:
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:count]
    for (file, line, func), (calls, _, tottime, cumtime, _) in rows:
        emit(bench="host_step_profile", loop=loop, func=f"{Path(file).name}:{line}:{func}", calls_per_step=round(calls / steps, 2),
             self_us=round(tottime / steps * 1e6, 1), cum_us=round(cumtime / steps * 1e6, 1))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=25)
    p.add_argument("--repeat", type=int, default=3, help="alternate the two loops this many times; the fastest run of each counts")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads: compute stays negligible, timings steadier")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print each loop's N functions of most self time")
    p.add_argument("--dump", default=None, metavar="PREFIX", help="also write PREFIX-engine.prof and PREFIX-cli.prof (pstats)")
    p.add_argument("--cli", nargs="*", default=[], help="extra CLI overrides")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.log_interval, args.repeat = 6, 2, 3, 1
    torch.set_num_threads(args.threads)
    # Other work on the machine slows whole runs down: alternate the loops and keep each number's lowest.
    runs = [(engine_loop(args), cli_loop(args)) for _ in range(args.repeat)]
    best = {}
    for name, found in (("engine", [e for e, _ in runs]), ("cli", [c for _, c in runs])):
        best[name] = {key: min(r[key] for r, _ in found) for key in found[0][0]}
        emit(bench="host_step", loop=name, batch=args.batch, steps=args.steps, runs=len(found), **best[name])
    emit(bench="host_step", what="cli_minus_engine_us", **{k: round(best["cli"][k] - best["engine"][k], 1) for k in best["cli"]})
    for name, prof in (("engine", runs[0][0][1]), ("cli", runs[0][1][1])):
        if prof is not None:
            top(prof, name, args.steps, args.profile)
            if args.dump:
                prof.dump_stats(f"{args.dump}-{name}.prof")


if __name__ == "__main__":
    main()

"""Tutorial ResNet-34 training throughput: plain PyTorch vs the engine, same batch, same data.

plain:   fp32 weights on the GPU, autocast fp16, fused Adam on the GPU, torch GradScaler.
rptrain: the tutorial's semantics: fp16 compute copy, fp32 master + Adam on the CPU (async step),
         rptrain GradScaler, forward_backward with the default microbatches and return_outputs.
roundpipe: the original RoundPipe library running the same code, only the imports swapped
         (``--impl roundpipe`` or ``all``; its wheel must be installed, and it needs CUDA).
All call loss.item() every step, as the tutorial does. Data sits in pinned host memory.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from common import emit, parser, sync, time_steps
from rptrain import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine import trace
from rptrain.models import build_model
from rptrain.optim import Adam


def batches(args, dtype: torch.dtype, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Where they wait: on the GPU with --data-on-device (as the CLI keeps a GPU-augmented dataset),
    else in host memory, pinned when a GPU reads them."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        x = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(dtype)
        y = torch.randint(0, 100, (args.batch,), generator=g)
        if args.data_on_device:
            x, y = x.to(args.device), y.to(args.device)
        elif args.device == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        out.append((x, y))
    return out


class Reader:
    """The loss (and accuracy) a training loop reads: every step as the tutorial does (a host sync per
    step), or summed on the device and read every ``interval`` steps as the CLI does."""

    def __init__(self, interval: int):
        self.interval, self.loss, self.correct = interval, 0, 0

    def __call__(self, i: int, loss, outputs=None, labels=None) -> None:
        self.loss = self.loss + loss.detach()
        if outputs is not None:
            self.correct = self.correct + outputs.max(1)[1].eq(labels.to(outputs.device)).sum()
        if (i + 1) % self.interval == 0:
            float(self.loss), float(self.correct)
            self.loss, self.correct = 0, 0


def plain(args, model_kwargs, memory_format: str = "contiguous", compiled: bool = False):
    device = args.device
    model = build_model("resnet34", **model_kwargs).to(device)
    if memory_format == "channels_last":  # weights too, as a user following PyTorch's guide would
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), fused=device == "cuda")
    layout = torch.channels_last if memory_format != "contiguous" else torch.contiguous_format
    if compiled:  # inductor on CUDA; on the CPU (CI) the eager backend checks the code path only
        model = torch.compile(model, backend="inductor" if device == "cuda" else "eager")
    scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
    criterion = nn.CrossEntropyLoss()
    data = batches(args, torch.float32)
    read = Reader(args.read_interval)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        x, y = x.to(device, non_blocking=True).contiguous(memory_format=layout), y.to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
            loss = criterion(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        read(i, loss)

    seconds = time_steps(step, args.steps, args.warmup, device)
    if args.profile and device == "cuda":
        gpu_busy(lambda: [step(i) for i in range(5)], lambda: None, "plain")
    return seconds


def plain_graphed(args, model_kwargs, memory_format: str = "channels_last", compiled: bool = False):
    """What a PyTorch expert writes for a launch-bound model: bf16 autocast (no loss scaling), fused Adam
    with capturable state, and the whole step (forward, backward, Adam) captured once in a CUDA graph and
    replayed; the batch is copied into the graph's static input. ``compiled``: the model is
    torch.compile'd (inductor) inside the graph. On the CPU (CI) the same step runs eagerly."""
    device = args.device
    cuda = device == "cuda"
    model = build_model("resnet34", **model_kwargs).to(device)
    layout = torch.channels_last if memory_format != "contiguous" else torch.contiguous_format
    if memory_format == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), fused=cuda, capturable=cuda)
    net = torch.compile(model, backend="inductor" if cuda else "eager") if compiled else model
    criterion = nn.CrossEntropyLoss()
    data = batches(args, torch.float32)
    static_x = data[0][0].clone().contiguous(memory_format=layout).to(device)
    static_y = data[0][1].clone().to(device)
    read = Reader(args.read_interval)

    def whole_step() -> torch.Tensor:
        # The cast weights must be recorded in the graph, not cached across its capture boundary.
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda, cache_enabled=False):
            loss = criterion(net(static_x).float(), static_y)
        loss.backward()
        opt.step()
        return loss.detach()

    graph, static_loss = None, None
    if cuda:  # warm up on a side stream (cuDNN picks, inductor compiles, Adam's state exists), then capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                whole_step()
        torch.cuda.current_stream().wait_stream(side)
        opt.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients in its pool: no zeroing per replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = whole_step()

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        if graph is not None:
            graph.replay()
            loss = static_loss
        else:
            opt.zero_grad(set_to_none=True)
            loss = whole_step()
        read(i, loss)

    return time_steps(step, args.steps, args.warmup, device)


def gpu_busy(run, finish, impl: str) -> None:
    """Fraction of wall time some kernel runs on the GPU, from a torch.profiler trace of 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        finish()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    if not kernels:
        return
    busy, cur_s, cur_e = 0.0, *kernels[0]
    for s, e in kernels[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = kernels[-1][1] - kernels[0][0]
    top = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    print(top, flush=True)
    emit(bench="resnet34_gpu_busy", impl=impl, steps=5, kernel_ms=round(busy / 1e3, 2), span_ms=round(span / 1e3, 2), busy_fraction=round(busy / span, 3))


def library(name: str) -> SimpleNamespace:
    """The tutorial's imports: from rptrain, or from the original RoundPipe library (``pip install
    roundpipe``; CUDA only, builds its C++ Adam on first use)."""
    if name == "roundpipe":
        import roundpipe

        return SimpleNamespace(RoundPipe=roundpipe.RoundPipe, OptimizerCtx=roundpipe.OptimizerCtx, GradScaler=roundpipe.GradScaler,
                               Adam=roundpipe.optim.Adam, RoundPipeRunConfig=roundpipe.RoundPipeRunConfig)
    return SimpleNamespace(RoundPipe=RoundPipe, OptimizerCtx=OptimizerCtx, GradScaler=GradScaler, Adam=Adam,
                           RoundPipeRunConfig=RoundPipeRunConfig)


def engine(args, model_kwargs, lib_name: str = "rptrain", optimizer_threads: int | None = None, memory_format: str = "contiguous"):
    lib = library(lib_name)
    cuda = args.device == "cuda"
    dtype = (torch.bfloat16 if args.bf16 else torch.float16) if cuda else torch.float32
    ours = lib_name == "rptrain"
    extra = dict(cuda_graphs=not args.no_graphs, optimizer_threads=optimizer_threads) if ours else {}
    if ours and args.no_gpu_state:  # passed only when set: gpu_suite.sh engine-ab runs an engine from before the option
        extra["gpu_state"] = False
    if ours and (args.no_whole_call or args.no_fuse):  # passed only when set, as --no-gpu-state
        extra["tuning"] = Tuning(**({"whole_call_graphs": False} if args.no_whole_call else {}),
                                 **({"fuse_microbatches": False} if args.no_fuse else {}))
    if ours and memory_format != "contiguous":  # inputs converted, weights stored channels-last (engine/memory_format.py)
        extra["memory_format"] = torch.channels_last
    model = lib.RoundPipe(build_model("resnet34", **model_kwargs).to(dtype), optim_dtype=torch.float32, **extra)
    with lib.OptimizerCtx():
        optimizer = lib.Adam(model.parameters())
    scaler = lib.GradScaler(enabled=cuda and not args.bf16)  # bf16 has fp32's range: no loss scaling
    criterion = nn.CrossEntropyLoss()
    data = batches(args, dtype)
    read = Reader(args.read_interval)
    n = torch.cuda.device_count() + 1 if args.device == "cuda" else 1
    # --metrics-on-device: the loss and outputs stay on the GPU, as the CLI keeps them (the tutorial's
    # default, the CPU, makes every call end with a copy down and its accuracy run on the CPU in fp16).
    where = dict(output_device=args.device) if args.metrics_on_device else {}
    cfg = lib.RoundPipeRunConfig(**({"num_microbatch": args.microbatches} if args.microbatches else {}), **where)

    def optimizer_step() -> None:
        if args.no_step:  # the engine alone: the compute copy is still written and uploaded
            return
        scaler.step(optimizer)
        optimizer.zero_grad()

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        loss, outputs = model.forward_backward(
            input_args=(x,), label=y, return_outputs=True, run_config=cfg,
            loss_fn=lambda out, lab: scaler.scale(criterion(out.float(), lab)) / n,
        )
        model.step(optimizer_step)
        scaler.update()
        read(i, loss, outputs, y)

    # The original library has no wait without a refresh: its synchronize() waits for the step.
    finish = model.wait_for_steps if ours else model.synchronize
    seconds = time_steps(step, args.steps, args.warmup, args.device, finish=finish)
    if not ours:
        return seconds
    if args.profile and args.device == "cuda":
        gpu_busy(lambda: [step(i) for i in range(5)], finish, "rptrain")
    if args.cprofile:
        main_thread_profile(step, finish, args.device)
    if args.trace:
        trace.clear()
        trace.enable()
        for i in range(5):
            step(i)
        model.wait_for_steps()
        trace.enable(False)
        summarize_trace(trace.spans())
    plan = model.plan
    emit(bench="resnet34_plan", forward_stages=len(plan.forward) if plan else None, backward_stages=len(plan.backward) if plan else None)
    # Which path the timed calls took (engine/callpath.py), and why a call ran stage by stage if one did.
    paths = [line.strip() for line in model.explain(data[0][0]).splitlines() if line.startswith(("call path", "  the last"))]
    emit(bench="resnet34_call_path", path=" | ".join(paths))
    model.close()
    return seconds


def main_thread_profile(step, finish, device: str, steps: int = 10, top: int = 25) -> None:
    """Where the Python time goes over 10 steps. Since Python 3.12 cProfile sees every thread, so the
    optimizer thread's calls (torch._fused_adam_, ...) appear beside the issuing thread's."""
    import cProfile
    import pstats

    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step(i)
    finish()
    sync(device)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, func), (calls, _, tottime, cumtime, _) in rows:
        emit(bench="resnet34_main_thread", func=f"{file.split('/')[-1]}:{line}:{func}", calls_per_step=round(calls / steps, 1),
             self_ms_per_step=round(tottime / steps * 1e3, 3), cum_ms_per_step=round(cumtime / steps * 1e3, 3))


def summarize_trace(spans) -> None:
    """Per span name: total ms over the traced steps, and how much the optimizer thread overlapped."""
    totals: dict[tuple[str, str], float] = {}
    for name, thread, start, stop in spans:
        key = (name.split(" ")[0] if name.startswith("issue") else name, "optimizer" if "optimizer" in thread else "main")
        totals[key] = totals.get(key, 0.0) + (stop - start) * 1e3
    for (name, thread), ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        emit(bench="resnet34_trace", span=name, thread=thread, total_ms=round(ms, 2))
    # From one call's final wait for the GPU to the next call's first issued job, the GPU has nothing queued
    # (the engine's tail and prologue, the loop's own work): per step, and as a share of the step.
    waits = sorted(e for n, t, s, e in spans if n == "wait_devices")
    issues = sorted(s for n, t, s, e in spans if n.startswith("issue"))
    gaps = [min(i for i in issues if i > w) - w for w in waits if any(i > w for i in issues)]
    if gaps:
        steps = (max(issues) - min(issues)) / len(gaps)  # first-issue to first-issue, averaged
        emit(bench="resnet34_trace", what="between_calls", ms_per_step=round(sum(gaps) / len(gaps) * 1e3, 3),
             share_of_step=round(sum(gaps) / len(gaps) / steps, 3), steps=len(gaps))
    fb = [(s, e) for n, t, s, e in spans if n == "forward_backward"]
    opt = [(s, e) for n, t, s, e in spans if n == "step_fn"]
    overlap = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in opt for s2, e2 in fb)
    busy = sum(e - s for s, e in opt)
    emit(bench="resnet34_trace", what="optimizer_step_overlapped_with_forward_backward", fraction=round(overlap / busy, 3) if busy else None)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--read-interval", type=int, default=1,
                   help="read the loss (and the engine's accuracy) every N steps; 1: every step, as the tutorial")
    p.add_argument("--impl", choices=["plain", "graphed", "rptrain", "both", "roundpipe", "all"], default="both",
                   help="both: plain and rptrain; graphed: plain with the whole step in one CUDA graph (bf16); "
                        "roundpipe: the original library; all: plain, rptrain and roundpipe")
    p.add_argument("--metrics-on-device", action="store_true",
                   help="engine: RoundPipeRunConfig(output_device=the GPU), loss and accuracy summed there (as the CLI does)")
    p.add_argument("--data-on-device", action="store_true",
                   help="the batches wait on the GPU (as the CLI's GPU-augmented dataset does), no upload per step")
    p.add_argument("--no-whole-call", action="store_true",
                   help="engine: Tuning(whole_call_graphs=False), each call stage by stage (stage graphs) instead of one recorded graph")
    p.add_argument("--no-fuse", action="store_true",
                   help="engine: Tuning(fuse_microbatches=False), a call's microbatches run apart (engine/fusion.py, fused_call.py)")
    p.add_argument("--no-gpu-state", action="store_true", help="engine: RoundPipe(gpu_state=False), all training state on the host")
    p.add_argument("--trace", action="store_true")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--profile", action="store_true", help="report GPU busy time from a torch.profiler trace")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    p.add_argument("--bf16", action="store_true", help="engine: bf16 compute copy without a GradScaler (the CLI's precision=bf16)")
    p.add_argument("--no-step", action="store_true", help="engine without the Adam step (its ceiling)")
    p.add_argument("--cprofile", action="store_true", help="cProfile 10 engine steps (all Python threads on 3.12+)")
    p.add_argument("--repeat", type=int, default=1, help="alternate plain and engine runs this many times")
    formats = ["contiguous", "channels_last", "inputs"]
    p.add_argument("--memory-format", choices=formats, nargs="*", default=["contiguous"],
                   help="one run of each implementation per value. channels_last: plain converts weights and inputs; "
                        "inputs: plain converts the inputs only; the engine runs memory_format=channels_last for either "
                        "(inputs converted, weights stored channels-last)")
    p.add_argument("--compile-formats", choices=formats, nargs="*", default=[],
                   help="plain: also one torch.compile'd run in each of these layouts")
    p.add_argument("--optimizer-threads", type=int, nargs="+", default=[None],
                   help="the engine's optimizer_threads; several values run the engine once each")
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True  # both sides pick their fastest convolutions
    if args.threads:
        torch.set_num_threads(args.threads)
    model_kwargs = {}
    if args.tiny:
        args.batch, args.steps, args.warmup, args.size = 4, 2, 1, 8
        model_kwargs = dict(widths=(8, 16, 32, 64), stem_channels=8)
    # The host's speed drifts (other tenants, clocks): alternating the runs and comparing each
    # engine run with the plain run just before it keeps the ratio honest.
    for _ in range(args.repeat):
        plain_rate = None
        if args.impl in ("plain", "both", "all"):
            for fmt, compiled in [(f, False) for f in args.memory_format] + [(f, True) for f in args.compile_formats]:
                seconds = plain(args, model_kwargs, fmt, compiled)
                plain_rate = plain_rate or args.batch / seconds  # the round's first plain run is the engine's yardstick
                emit(bench="resnet34", impl="plain", device=args.device, batch=args.batch, microbatches=1, read_interval=args.read_interval, memory_format=fmt,
                     compiled=compiled, step_ms=round(seconds * 1e3, 3), images_per_s=round(args.batch / seconds, 1))
        if args.impl == "graphed":
            for fmt, compiled in [(f, False) for f in args.memory_format] + [(f, True) for f in args.compile_formats]:
                seconds = plain_graphed(args, model_kwargs, fmt, compiled)
                emit(bench="resnet34", impl="graphed", device=args.device, batch=args.batch, microbatches=1, read_interval=args.read_interval,
                     memory_format=fmt, compiled=compiled, cuda_graph=args.device == "cuda", step_ms=round(seconds * 1e3, 3),
                     images_per_s=round(args.batch / seconds, 1))
        if args.impl in ("rptrain", "both", "all"):
            for threads, fmt in [(t, f) for f in args.memory_format for t in args.optimizer_threads]:
                seconds = engine(args, model_kwargs, optimizer_threads=threads, memory_format=fmt)
                rate = args.batch / seconds
                emit(bench="resnet34", impl="rptrain", device=args.device, batch=args.batch, microbatches=args.microbatches, read_interval=args.read_interval,
                     memory_format=fmt, metrics_on_device=args.metrics_on_device, data_on_device=args.data_on_device, cuda_graphs=not args.no_graphs,
                     whole_call=not args.no_whole_call, fuse=not args.no_fuse, optimizer_threads=threads, adam=not args.no_step, bf16=args.bf16, step_ms=round(seconds * 1e3, 3),
                     images_per_s=round(rate, 1), **({"rptrain_over_plain": round(rate / plain_rate, 3)} if plain_rate else {}))
        if args.impl in ("roundpipe", "all"):
            seconds = engine(args, model_kwargs, "roundpipe")
            rate = args.batch / seconds
            emit(bench="resnet34", impl="roundpipe", device=args.device, batch=args.batch, microbatches=args.microbatches,
                 step_ms=round(seconds * 1e3, 3), images_per_s=round(rate, 1),
                 **({"roundpipe_over_plain": round(rate / plain_rate, 3)} if plain_rate else {}))


if __name__ == "__main__":
    main()

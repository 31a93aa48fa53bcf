"""The optimizer step: torch's fused CPU Adam on N params (+ one pass writing the compute copy)
against the engine's whole step task (bind gradients, fused Adam, make the compute copy: on GPUs
that keep the model resident, partly cast there from the master; see engine/refresh.py).

Then the original library's ten other optimizers (``bench="optimizer_zoo"``): torch.optim's default
CPU implementation (its for-loop over separate tensors) against rptrain.optim's on the engine's flat
layout, on a ResNet-34's tensors and on a few big ones, with the kernel used and what the first
step (which compiles) costs. ``--zoo-only`` measures just these."""
from __future__ import annotations

import copy
import os
import statistics
import time

import torch
from torch import nn

from common import emit, parser
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.engine import trace
from rptrain.engine.tuning import Tuning
import rptrain.optim
from rptrain.optim import Adam
from rptrain.optim.kernels import compile_enabled

ZOO = ["SGD", "ASGD", "Adagrad", "Adadelta", "RMSprop", "Rprop", "Adamax", "NAdam", "RAdam", "Adafactor"]
ZOO_OPTIONS = {"SGD": dict(lr=0.01, momentum=0.9)}  # the others at torch's defaults


def layers_for(n_params: int, width: int) -> nn.Sequential:
    count = max(1, n_params // (width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(count)])


def plain_adam(model: nn.Sequential, compute_dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.Adam(params, fused=True)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    copy = torch.empty_like(flat, dtype=compute_dtype)
    opt.step()
    adam, cast = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        copy.copy_(flat)
        t2 = time.perf_counter()
        adam.append(t1 - t0)
        cast.append(t2 - t1)
    return statistics.median(adam), statistics.median(cast)


def engine_step(model: nn.Sequential, dtype: torch.dtype, width: int, repeats: int, device: str, share: float) -> dict[str, float]:
    engine = RoundPipe(model.to(dtype), tuning=Tuning(refresh_gpu_share=share))
    with OptimizerCtx():
        opt = Adam(engine.parameters())
    x = torch.randn(8, width, dtype=dtype)
    loss_fn = lambda out, _: out.float().pow(2).mean()
    cfg = RoundPipeRunConfig(num_microbatch=1)

    def iteration() -> None:
        engine.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()))

    for _ in range(3):
        iteration()
    engine.wait_for_steps()
    trace.clear()
    trace.enable()
    for _ in range(repeats):
        iteration()
    engine.wait_for_steps()
    trace.enable(False)
    per_span: dict[str, list[float]] = {}
    for name, thread, start, stop in trace.spans():
        per_span.setdefault(name, []).append(stop - start)
    engine.close()
    return {name: statistics.median(v) for name, v in per_span.items()}


def flat_vs_per_tensor(shapes: list[torch.Size], repeats: int) -> None:
    """torch's fused Adam called once per tensor (what torch.optim.Adam does) vs once on one flat tensor."""
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) * 1e-3 for s in shapes]
    states = [[torch.zeros(s) for s in shapes] for _ in range(2)]
    steps = [torch.zeros(()) for _ in shapes]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (params, grads, *states)]
    one_step = [torch.zeros(())]
    timings = {}
    for name, call in (
        ("per_tensor", lambda: torch._fused_adam_(params, grads, states[0], states[1], [], steps, **kw)),
        ("flat", lambda: torch._fused_adam_([flat[0]], [flat[1]], [flat[2]], [flat[3]], [], one_step, **kw)),
    ):
        call()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        timings[name] = statistics.median(samples)
    emit(bench="optimizer_layout", tensors=len(shapes), params=sum(s.numel() for s in shapes),
         per_tensor_ms=round(timings["per_tensor"] * 1e3, 2), flat_ms=round(timings["flat"] * 1e3, 2))


def _timed_step(opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def _median_steps(optimizers: list[torch.optim.Optimizer], repeats: int) -> list[tuple[float, float]]:
    """For each optimizer, seconds of its first step (state made, kernels compiled) and the median of
    ``repeats`` more; the optimizers take turns, so a busy machine slows them alike."""
    first = [_timed_step(opt) for opt in optimizers]
    for opt in optimizers:
        opt.step()
    samples: list[list[float]] = [[] for _ in optimizers]
    for _ in range(repeats):
        for opt, times in zip(optimizers, samples):
            times.append(_timed_step(opt))
    return [(f, statistics.median(times)) for f, times in zip(first, samples)]


def _flat_parameters(shapes: list[torch.Size]) -> list[nn.Parameter]:
    """Parameters and gradients as views of one flat buffer each, the engine's layout for one dtype."""
    total = sum(s.numel() for s in shapes)
    data, grads = torch.randn(total), torch.randn(total) * 1e-3
    params, offset = [], 0
    for s in shapes:
        p = nn.Parameter(data[offset : offset + s.numel()].view(s))
        p.grad = grads[offset : offset + s.numel()].view(s)
        params.append(p)
        offset += s.numel()
    return params


def _kernel(name: str, opt: torch.optim.Optimizer) -> str:
    if name in ("SGD", "Adagrad"):
        return "torch fused, once per flat run"
    kernel = type(opt)._kernel
    compiled = compile_enabled() and not kernel._failed
    if name == "Adafactor":
        return "compiled, once per tensor" if compiled else "torch for-loop"
    return "compiled one-pass, once per flat run" if compiled else "eager in 64K-element chunks"


def optimizer_zoo(names: list[str], sets: dict[str, list[torch.Size]], repeats: int) -> None:
    for set_name, shapes in sets.items():
        for name in names:
            options = ZOO_OPTIONS.get(name, {})
            separate = [nn.Parameter(torch.randn(s)) for s in shapes]
            for p in separate:
                p.grad = torch.randn_like(p) * 1e-3
            theirs = getattr(torch.optim, name)(separate, **options)
            ours = getattr(rptrain.optim, name)(_flat_parameters(shapes), **options)
            (torch_first, torch_step), (first, step) = _median_steps([theirs, ours], repeats)
            del separate, theirs
            saved = torch_step - step
            emit(bench="optimizer_zoo", optimizer=name, tensors=set_name, count=len(shapes), params=sum(s.numel() for s in shapes),
                 threads=torch.get_num_threads(), torch_ms=round(torch_step * 1e3, 2), rptrain_ms=round(step * 1e3, 2),
                 speedup=round(torch_step / step, 2), kernel=_kernel(name, ours), rptrain_first_step_s=round(first, 2),
                 torch_first_step_s=round(torch_first, 2),
                 break_even_steps=round((first - step) / saved) if saved > 0 else None)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--params", type=float, nargs="+", default=[21.3e6, 302e6])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu-shares", type=float, nargs="+", default=[Tuning.refresh_gpu_share],
                   help="shares of the resident copy cast on the GPU (engine/refresh.py) to compare")
    p.add_argument("--optimizers", nargs="*", default=ZOO, choices=ZOO, help="the original's other optimizers to measure")
    p.add_argument("--zoo-only", action="store_true", help="measure only the optimizers, not Adam's step in the engine")
    p.add_argument("--big", type=int, nargs=2, default=[4, 8 << 20], metavar=("COUNT", "NUMEL"),
                   help="the big tensors (matrices 4096 wide) of the optimizer comparison")
    args = p.parse_args()
    width = 1024 if args.tiny else 4096
    if args.tiny:
        args.params, args.repeats, args.big = [2e6], 2, [2, 1 << 16]
        os.environ["RPTRAIN_OPTIM_COMPILE"] = "0"  # CI: no compile time; the update's uncompiled form
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    from rptrain.models import build_model

    resnet = build_model("resnet34", widths=(8, 16, 32, 64)) if args.tiny else build_model("resnet34")
    shapes = [p.shape for p in resnet.parameters()]
    optimizer_zoo(args.optimizers, {"resnet34": shapes, "big": [torch.Size([args.big[1] // 4096, 4096])] * args.big[0]}, args.repeats)
    if args.zoo_only:
        return
    emit(bench="optimizer", threads=torch.get_num_threads())
    flat_vs_per_tensor([p.shape for p in resnet.parameters()], args.repeats)
    for n in args.params:
        model = layers_for(int(n), width)
        count = sum(p.numel() for p in model.parameters())
        adam, cast = plain_adam(model, dtype, args.repeats)
        for share in args.gpu_shares:
            spans = engine_step(copy.deepcopy(model), dtype, width, args.repeats, args.device, share)
            task = sum(spans.get(k, 0.0) for k in ("bind_grads", "step_fn", "write_compute_copy", "upload_resident", "stage_from_master"))
            emit(
                bench="optimizer", params=count, gpu_share=share, torch_fused_adam_ms=round(adam * 1e3, 2),
                compute_copy_pass_ms=round(cast * 1e3, 2), engine_step_task_ms=round(task * 1e3, 2),
                **{f"engine_{k}_ms": round(v * 1e3, 2) for k, v in spans.items()},
                params_per_s_torch=round(count / adam / 1e9, 2), ratio_engine_over_adam_plus_copy=round(task / (adam + cast), 3),
            )


if __name__ == "__main__":
    main()

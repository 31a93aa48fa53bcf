"""The optimizer step: torch's fused CPU Adam on N params (+ one pass writing the compute copy)
against the engine's whole step task (bind gradients, fused Adam, make the compute copy: on GPUs
that keep the model resident, partly cast there from the master; see engine/refresh.py)."""
from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from common import emit, parser
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.engine import trace
from rptrain.engine.tuning import Tuning
from rptrain.optim import Adam


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


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--params", type=float, nargs="+", default=[21.3e6, 302e6])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu-shares", type=float, nargs="+", default=[Tuning.refresh_gpu_share],
                   help="shares of the resident copy cast on the GPU (engine/refresh.py) to compare")
    args = p.parse_args()
    width = 1024 if args.tiny else 4096
    if args.tiny:
        args.params, args.repeats = [2e6], 2
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    emit(bench="optimizer", threads=torch.get_num_threads())
    from rptrain.models import build_model

    resnet = build_model("resnet34", widths=(8, 16, 32, 64)) if args.tiny else build_model("resnet34")
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

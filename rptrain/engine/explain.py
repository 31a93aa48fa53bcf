"""``RoundPipe.explain``: the plan and every device's actions of the next ``forward_backward`` call.

Nothing runs on a device: the plan is the one the next call would use (on a GPU before the first
call, that call measures one layer per stage, and says so), the schedule is lowered exactly as the
executor would lower it (actions.py) and the example inputs are only split into microbatches, to
show their shapes and bytes. The bytes of saved activations are shown once a GPU call has measured them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from .actions import Lowered, human_bytes, by_device
from .batching import iter_tensors, split_inputs
from .schedule import training_schedule

if TYPE_CHECKING:
    from .roundpipe import RoundPipe


def explain(engine: "RoundPipe", example_inputs: tuple, kwargs: dict) -> str:
    cfg = engine._resolve(None)
    plan, profile = engine._planner.training(cfg)
    jobs = training_schedule(plan, len(engine._devices), cfg.recompute_grain)
    offload = engine._planner.offload(jobs, cfg.num_microbatch)
    executor = engine._executor
    lowered = executor.lower(jobs, executor.facts(cfg.num_microbatch, profile, offload))
    lines = _header(engine, cfg, profile, offload)
    lines += ["stages:"] + [_stage(engine, item) for item in lowered]
    micro = split_inputs(tuple(example_inputs), dict(kwargs), cfg.num_microbatch, cfg.split_input) if example_inputs or kwargs else []
    for k, (args, kw) in enumerate(micro):
        tensors = [t for t in iter_tensors((args, kw)) if isinstance(t, Tensor)]
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)
        lines.append(f"input m{k}: {shapes} ({human_bytes(sum(t.nbytes for t in tensors))})")
    for device, actions in by_device(lowered).items():
        lines.append(f"d{device} ({engine._devices[device].torch_device}):")
        lines += [f"  {a}" for a in actions]
    return "\n".join(lines)


def _header(engine: "RoundPipe", cfg: Any, profile: bool, offload: bool) -> list[str]:
    executor = engine._executor
    weights = "resident on every GPU" if executor.resident else "streamed per stage" if executor.cuda else "in host memory"
    grads = "averaged across processes per stage (REDUCE)" if executor.reducing else "sent during the last microbatch's backward"
    lines = [
        f"RoundPipe: {len(engine._layers)} layer{'s' if len(engine._layers) != 1 else ''} on {', '.join(str(d.torch_device) for d in engine._devices)}; weights {weights}",
        f"microbatches {cfg.num_microbatch}, recompute grain {cfg.recompute_grain}, CUDA graphs "
        f"{'allowed' if executor.cuda_graphs else 'off'}, saved activations {'offloaded to host' if offload else 'kept on the device'}",
        f"gradients: {grads}",
    ]
    if profile:
        lines.append("this call measures every layer (one layer per stage); later calls run the plan made from it")
    return lines + str(engine.placement).splitlines()  # where master, gradients and optimizer state live (gpushare.py)


def _stage(engine: "RoundPipe", item: Lowered) -> str:
    job, sizes = item.job, engine._executor.sizes(item.job.start, item.job.stop)
    line = (f"  s{job.index} {job.kind.value:<8} layers {job.start}-{job.stop - 1} on d{job.device}: weights {human_bytes(sizes.weights)}, "
            f"buffers {human_bytes(sizes.buffers)}")
    if job.checkpoints:
        line += f", {'recomputes from' if job.kind.value == 'backward' else 'saves inputs of'} layers {list(job.checkpoints)}"
    measured = engine._planner.activation_bytes  # known after a GPU call measured the layers
    saved = sum(measured.get(c - 1, 0) for c in job.checkpoints) if measured is not None and job.kind.value == "forward" else 0
    if saved:  # the inputs of layer 0 are the call's (shown below), not measured
        line += f" ({human_bytes(saved)} per microbatch)"
    return line + (", CUDA graphs" if item.graphed else "")

"""``RoundPipe.explain``: the plan and every device's actions of the next ``forward_backward`` call.

Nothing runs on a device: the call is prepared as the next one would be (prepare.py: on a GPU before
the first call, that call measures one layer per stage, and says so), its schedule lowered exactly as
the executor would lower it (actions.py) and the example inputs are only split into microbatches, to
show their shapes and bytes. The bytes of saved activations are shown once a GPU call has measured them.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from .actions import Lowered, human_bytes, by_device
from .batching import iter_tensors, split_inputs
from .executor import Executor
from .planning import Planner
from .prepare import Prepared


def explain(call: Prepared, executor: Executor, planner: Planner, placement: Any, example_inputs: tuple, kwargs: dict,
            staged_microbatches: Optional[str] = None) -> str:
    """``call``: the next ``forward_backward``, prepared; ``placement``: fit.py's, printed as it is;
    ``staged_microbatches``: how the newest stage-by-stage call ran its microbatches (fused_call.py)."""
    cfg = call.cfg
    facts = executor.facts(cfg.num_microbatch, call.profile, call.offload)
    lowered = executor.lower(call.jobs, facts)
    lines = _header(executor, call, placement)
    path = executor.call_path(call.jobs, facts)
    lines.append(str(path))  # callpath.py: one graph for the whole call, or why stage by stage
    fallback = executor.whole_call_fallback()
    if path.whole and fallback:
        lines.append(f"  the last call ran stage by stage: {fallback}")
    microbatches = executor.whole_call_microbatches()
    if path.whole and microbatches and not fallback:
        lines.append(f"  the last recorded call's microbatches: {microbatches}")
    if not path.whole and staged_microbatches:
        lines.append(f"  the last stage-by-stage call's microbatches: {staged_microbatches}")
    lines += ["stages:"] + [_stage(executor, planner, item) for item in lowered]
    micro = split_inputs(tuple(example_inputs), dict(kwargs), cfg.num_microbatch, cfg.split_input) if example_inputs or kwargs else []
    for k, (args, kw) in enumerate(micro):
        tensors = [t for t in iter_tensors((args, kw)) if isinstance(t, Tensor)]
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)
        lines.append(f"input m{k}: {shapes} ({human_bytes(sum(t.nbytes for t in tensors))})")
    for device, actions in by_device(lowered).items():
        lines.append(f"d{device} ({executor.devices[device].torch_device}):")
        lines += [f"  {a}" for a in actions]
    return "\n".join(lines)


def _header(executor: Executor, call: Prepared, placement: Any) -> list[str]:
    cfg, layers = call.cfg, call.plan.num_layers
    weights = "resident on every GPU" if executor.resident else "streamed per stage" if executor.cuda else "in host memory"
    grads = "averaged across processes per stage (REDUCE)" if executor.reducing else "sent during the last microbatch's backward"
    lines = [
        f"RoundPipe: {layers} layer{'s' if layers != 1 else ''} on {', '.join(str(d.torch_device) for d in executor.devices)}; weights {weights}",
        f"microbatches {cfg.num_microbatch}, recompute grain {cfg.recompute_grain}, CUDA graphs "
        f"{'allowed' if executor.cuda_graphs else 'off'}, saved activations {'offloaded to host' if call.offload else 'kept on the device'}",
        f"gradients: {grads}",
    ]
    if call.profile:
        lines.append("this call measures every layer (one layer per stage); later calls run the plan made from it")
    return lines + str(placement).splitlines()  # where master, gradients and optimizer state live (gpushare.py)


def _stage(executor: Executor, planner: Planner, item: Lowered) -> str:
    job, sizes = item.job, executor.sizes(item.job.start, item.job.stop)
    line = (f"  s{job.index} {job.kind.value:<8} layers {job.start}-{job.stop - 1} on d{job.device}: weights {human_bytes(sizes.weights)}, "
            f"buffers {human_bytes(sizes.buffers)}")
    if job.checkpoints:
        line += f", {'recomputes from' if job.kind.value == 'backward' else 'saves inputs of'} layers {list(job.checkpoints)}"
    measured = planner.activation_bytes  # known after a GPU call measured the layers
    saved = sum(measured.get(c - 1, 0) for c in job.checkpoints) if measured is not None and job.kind.value == "forward" else 0
    if saved:  # the inputs of layer 0 are the call's (shown below), not measured
        line += f" ({human_bytes(saved)} {'for the joined batch' if planner.measured_joined else 'per microbatch'})"
    return line + (", CUDA graphs" if item.graphed else "")

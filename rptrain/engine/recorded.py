"""``model(x)`` with autograd on: the pipeline forward now, its backward when autograd asks.

The autograd function's inputs are every floating tensor of every microbatch's input, plus an
anchor that requires grad, so the outputs require grad even when no input does (images, token
ids): ``criterion(model(x), y).backward()`` then trains the weights, as in plain PyTorch. Its
outputs are every floating tensor of every microbatch's output; merging them (``torch.cat``,
averaging) happens outside, in autograd, and ``merge_output=False`` hands the per-microbatch
tensors over as they are, so a second model's backward reaches this one's. The call comes
prepared (prepare.py): the forward's jobs and the backward's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .batching import merge_outputs, pytree
from .executor import Executor
from .passstate import Args, PassState, float_tensors
from .prepare import Prepared
from .schedule import Job
from .versions import Versions


@dataclass(frozen=True)
class _Call:
    """What the backward needs of the engine: the call, its backward jobs, and where to run them."""

    forward: Prepared
    backward_jobs: tuple[Job, ...]
    versions: Versions
    executor: Executor
    run_training_pass: Callable[[PassState], None]  # RoundPipe's: runs a pass whose gradients go to the open window


def run_recorded(forward: Prepared, backward_jobs: tuple[Job, ...], micro: list, versions: Versions, executor: Executor,
                 run_training_pass: Callable[[PassState], None]) -> Any:
    call = _Call(forward, backward_jobs, versions, executor, run_training_pass)
    inputs = [float_tensors(Args(a, k)) for a, k in micro]
    holder: dict = {}
    anchor = torch.empty(0, requires_grad=True)
    flat_out = _Recorded.apply(call, micro, holder, [len(i) for i in inputs], anchor, *(t for i in inputs for t in i))
    it = iter(flat_out)
    outputs = [_with_floats(o, it) for o in holder["outputs"]]
    return merge_outputs(outputs, forward.cfg.merge_output)


def _with_floats(value: Any, replacements: Any) -> Any:
    """``value`` with its floating tensors taken from ``replacements`` in order."""
    return pytree.tree_map(lambda t: next(replacements) if isinstance(t, Tensor) and t.is_floating_point() else t, value)


_FIXED = 5  # _Recorded.forward's arguments before the flat inputs: call, micro, holder, counts, anchor


class _Recorded(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, micro: list, holder: dict, counts: list, anchor: Tensor, *flat_inputs: Tensor) -> Any:
        cfg = call.forward.cfg
        version = call.versions.use()
        state = PassState(
            call.forward.jobs, cfg.num_microbatch, [Args(a, k) for a, k in micro], version,
            preserve_rng=cfg.preserve_rng_state, output_device=cfg.output_device,
            input_requires_grad=any(t.requires_grad for t in flat_inputs), recompute_follows=True,
        )
        call.executor.run(state)
        holder["outputs"] = state.outputs
        per_micro = [float_tensors(o) for o in state.outputs]
        ctx.call, ctx.state, ctx.version = call, state, version
        ctx.out_counts, ctx.in_counts = [len(o) for o in per_micro], counts
        ctx.input_devices = [t.device for t in flat_inputs]
        return tuple(t.detach() for o in per_micro for t in o)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> Any:
        call: _Call = ctx.call
        cfg = call.forward.cfg
        if call.versions.required != ctx.version:
            raise RuntimeError("RoundPipe: backward() must run before the next step()/synchronize() of the same model")
        grads_per_micro = _chunk(list(grad_outputs), ctx.out_counts)
        buffer = call.versions.open_window()
        input_requires_grad = any(ctx.needs_input_grad[_FIXED:])
        state = PassState(
            call.backward_jobs, cfg.num_microbatch, grads_per_micro, ctx.version, grad_buffer=buffer,
            preserve_rng=cfg.preserve_rng_state, input_requires_grad=input_requires_grad,
        )
        state.saved, state.rng, state.recompute_data = ctx.state.saved, ctx.state.rng, ctx.state.recompute_data
        ctx.state = None  # the saved activations go with this backward
        call.run_training_pass(state)
        input_grads: list = [None] * sum(ctx.in_counts)
        if input_requires_grad:
            k = 0
            for count, grads in zip(ctx.in_counts, state.input_grads):
                for i in range(count):
                    g = grads[i] if grads is not None else None
                    if g is not None and ctx.needs_input_grad[_FIXED + k]:
                        input_grads[k] = g.to(ctx.input_devices[k])
                    k += 1
        return (None,) * _FIXED + tuple(input_grads)


def _chunk(flat: list, counts: list[int]) -> list[list]:
    out, k = [], 0
    for count in counts:
        out.append(flat[k : k + count])
        k += count
    return out

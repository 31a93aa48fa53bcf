"""CUDA graphs for a fused stage's forward and backward, so small layers stop paying launch costs.

A graph replays the exact kernels it recorded, reading and writing the same addresses. That holds
for a fused stage whose weights stay resident on the GPU (a static "live" copy), whose buffers and
parameter gradients sit in static tensors, and whose input has the same shapes as when it was
recorded. Two graphs per stage: the forward, and the backward including the accumulation into
the parameters' ``.grad`` (in place, so a replay adds to the static gradient tensors without the
per-parameter launches eager autograd would pay). The loss function runs eagerly between them.
Recording runs the stage a few times first; those runs' statistics updates, random numbers and
gradients are put back. A stage that cannot be recorded runs eagerly from then on.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from . import rng
from .tuning import Tuning

class _TooLarge(Exception):
    pass


def signature(value: Any) -> Optional[tuple]:
    """A hashable description of the input's structure, shapes and constants (None: not graphable)."""
    leaves, spec = pytree.tree_flatten(value)
    parts = []
    for v in leaves:
        if isinstance(v, Tensor):
            parts.append(("t", tuple(v.shape), v.dtype, v.requires_grad, v.device))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            parts.append(("c", v))
    return (spec, tuple(parts))


class WarmupUndo:
    """What a recording's warm-up runs change in its layers (buffers such as BatchNorm's running statistics,
    accumulated gradients), copied before them and put back after, so a recorded call counts once."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.buffers = [b for m in modules for b in m.buffers()]
        self.params = [p for m in modules for p in m.parameters()]
        self.saved_buffers = [b.detach().clone() for b in self.buffers]
        self.saved_grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    @torch.no_grad()
    def restore(self) -> None:
        for b, value in zip(self.buffers, self.saved_buffers):
            b.copy_(value)
        for p, value in zip(self.params, self.saved_grads):
            if value is not None:
                p.grad.copy_(value)


class _Recorded:
    """One stage's forward and backward graphs (no backward: a forward-only graph) and the static tensors they read and write."""

    def __init__(self, forward: torch.cuda.CUDAGraph, backward: Optional[torch.cuda.CUDAGraph], inputs: list[Tensor],
                 outputs: list[Tensor], differentiable: list[int], grad_outputs: list[Tensor],
                 out_spec: pytree.TreeSpec, out_constants: list):
        self.forward, self.backward = forward, backward
        self.inputs, self.outputs = inputs, outputs
        self.differentiable, self.grad_outputs = differentiable, grad_outputs
        self.out_spec, self.out_constants = out_spec, out_constants


class _Replay(torch.autograd.Function):
    """The recorded stage as one autograd node: forward replays one graph, backward the other."""

    @staticmethod
    def forward(ctx: Any, rec: _Recorded, anchor: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
        for static, x in zip(rec.inputs, inputs):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        rec.forward.replay()
        ctx.rec = rec
        outputs = tuple(o.detach() for o in rec.outputs)  # new tensor objects, the static memory
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outputs) if i not in rec.differentiable])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        rec: _Recorded = ctx.rec
        for i, static in zip(rec.differentiable, rec.grad_outputs):
            if grads[i] is None:
                static.zero_()
            else:
                static.copy_(grads[i])
        rec.backward.replay()  # also adds the parameters' gradients into their static .grad
        return (None, None, *[t.grad for t in rec.inputs])


def _staged(modules: list[nn.Module], x: Any, call: Callable, keep_grad: bool) -> tuple[list[Tensor], Callable[[], Any]]:
    """(static copies of ``x``'s tensors, the stage run on them): what a recording captures."""
    leaves, spec = pytree.tree_flatten(x)
    constants = [None if isinstance(v, Tensor) else v for v in leaves]
    inputs = [v.detach().clone().requires_grad_(keep_grad and v.requires_grad) for v in leaves if isinstance(v, Tensor)]

    def stage() -> Any:
        it = iter(inputs)
        y = pytree.tree_unflatten([next(it) if c is None else c for c in constants], spec)
        for layer in modules:
            y = call(layer, y)
        return y

    return inputs, stage


class StageGraphs:
    """Recorded stages on one device, by (layers, training modes, input signature)."""

    def __init__(self, device: torch.device, tuning: Tuning):
        self.device = device
        self.tuning = tuning
        self._graphs: dict[tuple, Optional[_Recorded]] = {}
        self._seen: set[tuple] = set()  # forward-only keys met once, not recorded yet
        self._pool = None
        self._stream: Optional[torch.cuda.Stream] = None
        # Outputs of the replay node need an input that requires grad even when nothing else does.
        self._anchor: Optional[Tensor] = None

    def replays(self, key: tuple) -> bool:
        """Whether inputs with ``key`` replay a recorded graph (else they run eagerly)."""
        return self._graphs.get(key) is not None

    def run(self, key: tuple, modules: list[nn.Module], x: Any, call: Callable, grad: bool = True) -> Any:
        """``x`` through the stage: replayed when recorded, recorded on first sight, else eager.
        The caller's backward of the result replays the backward graph. ``grad=False`` (a call under
        torch.no_grad, and ``key`` says so): a forward graph alone, whose outputs live in memory the next
        replay overwrites."""
        if key not in self._graphs and not grad and key not in self._seen:
            # A forward-only shape is recorded when it comes back: an evaluation's batches repeat, while a
            # generation's growing lengths come once each and would fill the recordings with one-off graphs.
            self._seen.add(key)
            return self._eager(modules, x, call)
        if key not in self._graphs:
            recorded = sum(rec is not None for rec in self._graphs.values())
            if recorded < self.tuning.max_recorded_graphs:
                self._graphs[key] = self._record(modules, x, call, grad)
            else:
                warnings.warn(f"rptrain: {recorded} input shapes already recorded as CUDA graphs; new shapes run eagerly", stacklevel=3)
                self._graphs[key] = None
        rec = self._graphs[key]
        return self._eager(modules, x, call) if rec is None else self._replay(rec, modules, x, call)

    @staticmethod
    def _eager(modules: list[nn.Module], x: Any, call: Callable) -> Any:
        for layer in modules:
            x = call(layer, x)
        return x

    def _replay(self, rec: _Recorded, modules: list[nn.Module], x: Any, call: Callable) -> Any:
        inputs = [v for v in pytree.tree_leaves(x) if isinstance(v, Tensor)]
        if rec.backward is None:  # forward only
            for static, v in zip(rec.inputs, inputs):
                static.copy_(v)
            rec.forward.replay()
            outputs = [o.detach() for o in rec.outputs]
        else:
            outputs = _Replay.apply(rec, self._anchor, *inputs)
        it = iter(outputs)
        return pytree.tree_unflatten([next(it) if c is None else c for c in rec.out_constants], rec.out_spec)

    def _record(self, modules: list[nn.Module], x: Any, call: Callable, grad: bool = True) -> Optional[_Recorded]:
        undo = WarmupUndo(modules)
        rng_state = rng.get_state(self.device)
        try:
            return self._capture(modules, x, call) if grad else self._capture_forward(modules, x, call)
        except _TooLarge as e:
            warnings.warn(f"rptrain: running layers {type(modules[0]).__name__}.. eagerly: {e}", stacklevel=3)
            return None
        except Exception as e:  # anything a graph cannot hold: keep the stage eager
            warnings.warn(f"rptrain: running layers {type(modules[0]).__name__}.. eagerly, CUDA graph capture failed: {e}", stacklevel=3)
            return None
        finally:
            if self._stream is not None:  # the caller's stream continues after the recording stream's work
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            undo.restore()  # the warm-up runs updated statistics and gradients
            rng.set_state(rng_state, self.device)

    def _ensure_pool(self) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
            self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def _capture_forward(self, modules: list[nn.Module], x: Any, call: Callable) -> _Recorded:
        """The stage's forward under torch.no_grad as one graph (an evaluation's: nothing saved for a backward)."""
        inputs, stage = _staged(modules, x, call, keep_grad=False)
        self._ensure_pool()
        with torch.cuda.stream(self._stream), torch.no_grad():
            for _ in range(self.tuning.graph_warmup):
                stage()
            forward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                out_leaves, out_spec = pytree.tree_flatten(stage())
        outputs = [v.detach() for v in out_leaves if isinstance(v, Tensor)]
        out_constants = [None if isinstance(v, Tensor) else v for v in out_leaves]
        return _Recorded(forward, None, inputs, outputs, [], [], out_spec, out_constants)

    def _capture(self, modules: list[nn.Module], x: Any, call: Callable) -> _Recorded:
        inputs, stage = _staged(modules, x, call, keep_grad=True)

        def differentiable(out_leaves: list) -> list[Tensor]:
            return [v for v in out_leaves if isinstance(v, Tensor) and v.requires_grad]

        self._ensure_pool()  # everything on one stream: autograd runs a node's backward on its forward's stream
        budget = self.tuning.max_graph_memory_share * torch.cuda.get_device_properties(self.device).total_memory
        with torch.cuda.stream(self._stream), torch.enable_grad():
            for _ in range(self.tuning.graph_warmup):
                before = torch.cuda.memory_allocated(self.device)
                outs = differentiable(pytree.tree_leaves(stage()))
                kept = torch.cuda.memory_allocated(self.device) - before  # activations saved for the backward
                if kept > budget:
                    raise _TooLarge(f"its forward keeps {kept / 2**30:.1f} GiB, over {self.tuning.max_graph_memory_share:.0%} of the GPU, "
                                    "too much for a CUDA graph's private memory")
                if outs:
                    torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])
                del outs
            for t in inputs:
                t.grad = None
            forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                out_leaves, out_spec = pytree.tree_flatten(stage())
            outputs = [v for v in out_leaves if isinstance(v, Tensor)]
            wanted = [i for i, v in enumerate(outputs) if v.requires_grad]
            grad_outputs = [torch.empty_like(outputs[i]) for i in wanted]
            with torch.cuda.graph(backward, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                if wanted:
                    torch.autograd.backward([outputs[i] for i in wanted], grad_outputs)
        out_constants = [None if isinstance(v, Tensor) else v for v in out_leaves]
        detached = [o.detach() for o in outputs]
        return _Recorded(forward, backward, inputs, detached, wanted, grad_outputs, out_spec, out_constants)

"""What one job computes for one microbatch: forward, fused (forward, loss, backward) or backward.

Forward stages save their inputs at checkpoints (on the host when the lowering says so: actions.py);
backward stages recompute from them with each microbatch's RNG state replayed, one segment at a
time, last segment first. A fused stage may replay CUDA graphs (graphs.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from . import recompute
from .actions import Lowered
from .batching import iter_tensors, map_tensors
from .device import Device
from .grads import EarlyGrads
from .passstate import PassState, call_layer, float_tensors, make_leaves
from .replica import Shell
from .scaler import recording_scalers
from .graphs import signature
from .schedule import Job, JobKind
from .weights import StageTensors


@dataclass
class JobRun:
    """One job while it runs: its device, tensors and modules, and the lowering's decisions."""

    lowered: Lowered
    device: Device
    shells: list[Shell]
    weights: Optional[StageTensors] = None
    frozen: Optional[StageTensors] = None
    buffers: Optional[StageTensors] = None
    grads: Optional[StageTensors] = None
    modules: Optional["BoundOnUse"] = None
    early: Optional[EarlyGrads] = None
    buffer_versions: Optional[list[int]] = None  # before the first microbatch (None: graphed)
    start_mark: Any = None  # profiling: the compute stream's timer at the start

    @property
    def job(self) -> Job:
        return self.lowered.job


def _run_layers(run: JobRun, a: int, b: int, x: Any, micro: int, state: PassState, saves: tuple = ()) -> Any:
    job, modules, device = run.job, run.modules, run.device
    for i in range(a, b):
        if i in saves:
            if run.lowered.offload:  # GPU memory then bounds one layer, not the sequence
                state.saved[(i, micro)] = (_to_host(device, x), device.record("download"), None)
            else:
                state.saved[(i, micro)] = (x, device.record("compute"), device)
            if state.preserve_rng:
                state.rng[(i, micro)] = device.rng_state()
        with _recompute_context(job, i, micro, state, device) as store:
            x = call_layer(modules[i - job.start], x)
        if store and job.kind is JobKind.FORWARD and (i, micro) in store:  # moved to the recomputing device later
            store[(i, micro)] = (store[(i, micro)], device.record("compute"), device)
    return x

@contextlib.contextmanager
def _recompute_context(job: Job, layer: int, micro: int, state: PassState, device: Device) -> Iterator[Optional[dict]]:
    """recompute.py's context for one layer call: forward stages save, backward stages read."""
    key = (layer, micro)
    if job.kind is JobKind.BACKWARD and key in state.recompute_data:
        data, event, source = state.recompute_data.pop(key)
        store = {key: device.receive(data, event, source)}
    else:
        store = state.recompute_data if job.kind is JobKind.FORWARD and state.recompute_follows else None
    with recompute.layer_call(store, key, job.kind is JobKind.BACKWARD):
        yield store

def forward(run: JobRun, x: Any, micro: int, state: PassState) -> Any:
    job, device = run.job, run.device
    key = signature(x) if run.lowered.graphed and state.graphs is not None else None
    with torch.no_grad():
        if key is not None:  # an evaluation's only stage: a forward graph, its outputs copied out of its static memory
            out = map_tensors(torch.clone, state.graphs.run((job.start, job.stop, state.graph_modes, "forward", key), run.modules, x,
                                                            call_layer, grad=False))
        else:
            out = _run_layers(run, job.start, job.stop, x, micro, state, job.checkpoints)
    if state.profile:
        state.activation_bytes[job.start] = max(state.activation_bytes.get(job.start, 0), sum(t.nbytes for t in iter_tensors(out)))
    if job.index == len(state.jobs) - 1:  # the call's output
        state.outputs[micro] = to_output(device, out, state)
    return out

def fused(run: JobRun, x: Any, micro: int, state: PassState) -> Any:
    job, modules, device = run.job, run.modules, run.device
    needs_input_grad = job.index > 0 or state.input_requires_grad
    label = device.receive(state.labels[micro], None, None)
    with torch.enable_grad(), _SavedBytes(state, job.start, weights=modules) as counter:
        leaves = make_leaves(x, needs_input_grad)
        key = None if state.graphs is None else signature(leaves)
        if key is not None:
            key = (job.start, job.stop, state.graph_modes, key)
            out = state.graphs.run(key, modules, leaves, call_layer)
        else:
            out = _run_layers(run, job.start, job.stop, leaves, micro, state)
        with recording_scalers(state.scalers):
            loss = state.loss_fn(out, label)
        losses = loss_scalars(loss)
        counter.stop()
        trained = [t for t in losses if t.requires_grad]
        if trained:  # as torch.autograd.backward(loss): every loss that needs it, the original library's semantics
            with _watch_grads(run, micro, state, eager=key is None or not state.graphs.replays(key)):
                torch.autograd.backward(trained)
    # A loss_fn that returns the graph's own output (``lambda out, _: out``) hands back memory the
    # next replay overwrites: the call then returned microbatch 1's loss twice (H200, bench/graph_frozen.py).
    kept = [t.detach().reshape(()) if key is None else t.detach().reshape(()).clone() for t in losses]
    state.losses[micro] = kept[0] if isinstance(loss, Tensor) else kept
    if state.want_outputs:
        # A graph's outputs live in memory its next replay overwrites: copy them first.
        keep = (lambda t: t.detach().clone()) if key is not None else Tensor.detach
        state.outputs[micro] = to_output(device, map_tensors(keep, out), state)
    if not needs_input_grad:
        return None
    # A graph returns input gradients in memory its next replay overwrites.
    grads = [t.grad if key is None or t.grad is None else t.grad.clone() for t in float_tensors(leaves)]
    if job.start == 0:
        state.input_grads[micro] = grads
    return grads

def loss_scalars(loss: Any) -> list[Tensor]:
    """``loss_fn``'s result as a list of scalar tensors: one, or a sequence of them (several losses)."""
    items = [loss] if isinstance(loss, Tensor) else list(loss) if isinstance(loss, (tuple, list)) and loss else None
    if items is None or not all(isinstance(t, Tensor) and t.numel() == 1 for t in items):
        got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor or a sequence of them, got {got}")
    return items


def backward(run: JobRun, grads: Any, micro: int, state: PassState) -> Any:
    with _watch_grads(run, micro, state, eager=True):
        return _backward_segments(run, grads, micro, state)

def _watch_grads(run: JobRun, micro: int, state: PassState, eager: bool) -> contextlib.AbstractContextManager:
    """During the last microbatch's eager backward, send each gradient home once it is final."""
    early = run.early
    return early.watching() if early is not None and eager and micro == state.num_microbatch - 1 else contextlib.nullcontext()

def _backward_segments(run: JobRun, grads: Any, micro: int, state: PassState) -> Any:
    job, modules, device = run.job, run.modules, run.device
    starts = job.checkpoints or (job.start,)
    segments = list(zip(starts, list(starts[1:]) + [job.stop]))
    for a, b in reversed(segments):
        saved, event, source = state.saved.pop((a, micro))
        x = device.receive(saved, event, source)
        needs_input_grad = a > 0 or state.input_requires_grad
        with torch.enable_grad(), device.replay_rng(state.rng.pop((a, micro), None)), _SavedBytes(state, a, weights=modules):
            leaves = make_leaves(x, needs_input_grad)
            out = _run_layers(run, a, b, leaves, micro, state)
            pairs = [(o, g) for o, g in zip(float_tensors(out), grads or ()) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [t.grad for t in float_tensors(leaves)] if needs_input_grad else None
    if job.start == 0:
        state.input_grads[micro] = grads
    return grads

def to_output(device: Device, value: Any, state: PassState) -> Any:
    target = state.output_device
    if not device.is_cuda or target == device.torch_device:
        return map_tensors(lambda t: t.to(target), value)
    return _download(device, value, lambda t: t.to(target, non_blocking=True))

def _to_host(device: Device, value: Any) -> Any:
    """Copy to pinned host memory on the download stream (the caller records its event)."""

    def pinned(t: Tensor) -> Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=device.pins_memory)
        return host.copy_(t, non_blocking=True)

    return _download(device, value, pinned)


def _download(device: Device, value: Any, copy: Callable[[Tensor], Tensor]) -> Any:
    """``copy`` every tensor of ``value`` on the download stream, after the compute issued so far."""
    ready = device.record("compute")
    with device.stream("download"):
        device.wait("download", ready)

        def move(t: Tensor) -> Tensor:
            device.keep_alive(t, "download")
            return copy(t)

        return map_tensors(move, value)


class BoundOnUse:
    """The job's modules: the shells bound to the job's tensors on first use."""

    def __init__(self, shells: list[Shell], weights: StageTensors, frozen: StageTensors, buffers: StageTensors, grads: Optional[StageTensors]):
        self._shells, self._tensors = shells, (weights, frozen, buffers, grads)
        self._modules: Optional[list[torch.nn.Module]] = None

    def bind(self) -> list[torch.nn.Module]:
        if self._modules is None:
            weights, frozen, buffers, grads = self._tensors
            self._modules = [s.bind(weights.view, frozen.view, buffers.view, grads.view if grads else None) for s in self._shells]
        return self._modules

    def __getitem__(self, i: int) -> torch.nn.Module:
        return self.bind()[i]

    def __iter__(self) -> Any:
        return iter(self.bind())

    def release(self) -> None:
        if self._modules is not None:
            for s in self._shells:
                s.release()
            self._modules = None


def buffer_versions(shells: list[Shell]) -> list[int]:
    """In-place updates (BatchNorm statistics) bump these counters."""
    return [b._version for s in shells for b, _ in s.buffers]


class _SavedBytes:
    """Counts the bytes autograd saves for backward in a block (only when profiling)."""

    def __init__(self, state: PassState, layer: int, weights: list):
        self.state, self.layer = state, layer
        self.active = state.profile
        self.seen: set[int] = set()
        self.total = 0
        if self.active:
            self.exclude = {p.untyped_storage().data_ptr() for m in weights for p in m.parameters()}

    def _pack(self, t: Tensor) -> Tensor:
        if self.active:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.seen and ptr not in self.exclude:
                self.seen.add(ptr)
                self.total += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> "_SavedBytes":
        if self.state.profile:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self.hooks.__enter__()
        return self

    def stop(self) -> None:
        self.active = False

    def __exit__(self, *exc: Any) -> None:
        if self.state.profile:
            self.hooks.__exit__(*exc)
            previous = self.state.saved_bytes.get(self.layer, 0)
            self.state.saved_bytes[self.layer] = max(previous, self.total)

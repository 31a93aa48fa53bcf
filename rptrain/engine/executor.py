"""Runs a schedule (a list of jobs) on the devices.

One job = one stage on one device for every microbatch: bind the stage's weights (uploaded on the
upload stream while the previous job computes), run the microbatches on the compute stream, then
send gradients (and changed buffers) home on the download stream. Results pass between jobs
through a mailbox keyed by (job, microbatch) with the event that marks them ready, so devices
never wait on a global barrier. With one device the jobs run inline in the calling thread; with
several, each device gets a thread for the call.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import recompute, refresh
from .batching import iter_tensors, map_tensors, opaque_type
from .device import Device
from .graphs import StageGraphs, signature, worth_recording
from .host import GradBuffer, HostState
from .layout import FlatLayout, Range, Slot, shaped
from .memory_format import convert_inputs
from .replica import Shell
from .scaler import recording_scalers
from .schedule import Job, JobKind
from .trace import span


class Args(NamedTuple):
    """The first layer's input: the call's positional and keyword arguments."""

    args: tuple
    kwargs: dict


def call_layer(module: torch.nn.Module, x: Any) -> Any:
    return module(*x.args, **x.kwargs) if isinstance(x, Args) else module(x)


def float_tensors(value: Any) -> list[Tensor]:
    return [t for t in iter_tensors(value) if t.is_floating_point()]


def make_leaves(value: Any, requires_grad: bool) -> Any:
    """Cut ``value`` from any graph; floating tensors become leaves that collect gradients."""
    if requires_grad and (hidden := opaque_type(value)) is not None:
        raise TypeError(
            f"a {hidden.__module__}.{hidden.__qualname__} passed between layers holds tensors the engine cannot see, so "
            "no gradient would reach the layers before it: register the type with torch.utils._pytree.register_pytree_node"
        )
    return map_tensors(lambda t: t.detach().requires_grad_(requires_grad and t.is_floating_point()), value)


class PassFailed(RuntimeError):
    """Another device's job failed; this one stops."""


class Mailbox:
    def __init__(self, state: "PassState"):
        self._items: dict[tuple[int, int], tuple[Any, Any, Optional[Device]]] = {}
        self._cond = threading.Condition()
        self._state = state

    def put(self, job: int, micro: int, value: Any, event: Any, device: Optional[Device]) -> None:
        with self._cond:
            self._items[(job, micro)] = (value, event, device)
            self._cond.notify_all()

    def take(self, job: int, micro: int) -> tuple[Any, Any, Optional[Device]]:
        with self._cond:
            while (job, micro) not in self._items:
                if self._state.error is not None:
                    raise PassFailed("stopped because another device failed")
                self._cond.wait(timeout=0.5)
            return self._items.pop((job, micro))

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


@dataclass
class PassState:
    """Everything one call's jobs share."""

    jobs: Sequence[Job]
    num_microbatch: int
    first_inputs: Sequence[Any]  # per microbatch: Args for forward kinds, output gradients for backward
    version: int  # which compute copy the weights come from
    labels: Sequence[Any] = ()
    loss_fn: Optional[Callable] = None
    grad_buffer: Optional[GradBuffer] = None
    preserve_rng: bool = True
    want_outputs: bool = False
    output_device: torch.device = torch.device("cpu")
    input_requires_grad: bool = False
    profile: bool = False
    offload: bool = False  # keep saved activations in pinned host memory instead of on the GPU
    # Carried from a recorded forward into its backward.
    saved: dict = field(default_factory=dict)  # (layer, micro) -> (value, event, device)
    rng: dict = field(default_factory=dict)  # (layer, micro) -> generator state
    recompute_data: dict = field(default_factory=dict)  # (layer, micro) -> (save_for_recompute data, event, device)
    recompute_follows: bool = False  # forward stages' layers run again in backward stages
    # Results.
    losses: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    input_grads: list = field(default_factory=list)
    scalers: dict = field(default_factory=dict)  # GradScaler -> scale used
    nonfinite: dict = field(default_factory=dict)  # device index -> bool tensor
    deferred_adds: list = field(default_factory=list)  # (host dst, staged src) added after the sync
    early_grads: dict = field(default_factory=dict)  # job index -> _EarlyGrads
    timings: list = field(default_factory=list)  # (job, device, start mark, stop mark)
    saved_bytes: dict = field(default_factory=dict)  # layer -> bytes of one microbatch's graph
    activation_bytes: dict = field(default_factory=dict)  # layer -> bytes of one microbatch's output
    error: Optional[BaseException] = None

    def __post_init__(self) -> None:
        self.graphs: Optional[StageGraphs] = None
        self.graph_modes: tuple = ()
        self.chain = Mailbox(self)
        self.prefetched: dict[int, Any] = {}
        self.buffer_events: list[Any] = []
        self.lock = threading.Lock()
        n = self.num_microbatch
        self.losses, self.outputs, self.input_grads = [None] * n, [None] * n, [None] * n

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None or isinstance(self.error, PassFailed):
                self.error = error
        self.chain.wake()


class StageTensors:
    """Device tensors holding some ranges of a flat layout, and views of single slots in them."""

    def __init__(self, layout: FlatLayout, pieces: list[tuple[Range, Tensor]], event: Any = None):
        self.layout = layout
        self.pieces = pieces
        self.event = event

    def view(self, slot: Slot) -> Tensor:
        return shaped(self.flat(slot), slot)

    def flat(self, slot: Slot) -> Tensor:
        """The slot's elements as one 1-D tensor, in storage order."""
        for r, t in self.pieces:
            if r.key == slot.key and r.start <= slot.offset < r.stop:
                start = slot.offset - r.start
                return t[start : start + slot.numel]
        raise KeyError(f"slot {slot.index} is not part of this stage")


class _Resident:
    """The whole compute copy on one GPU: upload slots by version, and the live copy jobs read."""

    def __init__(self) -> None:
        self.staged: dict[int, StageTensors] = {}
        self.live: Optional[list[tuple[Range, Tensor]]] = None
        self.live_version: Optional[int] = None

    def publish(self, version: int, staged: StageTensors) -> None:
        """Keep ``staged`` as ``version`` and forget versions no call can ask for any more."""
        self.staged[version] = staged
        for old in [v for v in self.staged if v < version - 1]:
            del self.staged[old]


class Executor:
    def __init__(self, layers: Sequence[torch.nn.Module], host: HostState, devices: Sequence[Device]):
        self.layers = layers
        self.host = host
        self.devices = devices
        self._shells: dict[tuple[int, int], Shell] = {}
        self._resident: dict[int, _Resident] = {}
        self._resident_frozen: dict[int, StageTensors] = {}  # device index -> the frozen weights, whole
        self._resident_lock = threading.Lock()
        self._static_buffers: dict[tuple[int, int, int], StageTensors] = {}
        self._static_grads: dict[tuple[int, int, int], StageTensors] = {}
        self._graphs: dict[int, StageGraphs] = {}
        self.reducer = None  # a GradReducer when gradients are averaged across processes
        self.resident = False  # keep the whole compute copy on every GPU
        self.cuda_graphs = False  # replay fused stages as CUDA graphs (needs resident weights)
        self.memory_format: Optional[torch.memory_format] = None  # the layout of 4-D inputs (memory_format.py)
        self._refresh_plan: Optional[tuple[list[Range], list[Range]]] = None

    # ----------------------------------------------------------------------------- running a call
    def run(self, state: PassState) -> None:
        by_device: dict[int, list[Job]] = {}
        for job in state.jobs:
            by_device.setdefault(job.device, []).append(job)
        state.next_on_device = {}
        state.reduce_order = {j.index: k for k, j in enumerate(j for j in state.jobs if j.kind is not JobKind.FORWARD)}
        if self.reducer is not None:
            self.reducer.begin()
        for jobs in by_device.values():
            for a, b in zip(jobs, jobs[1:]):
                state.next_on_device[a.index] = b
        for index in by_device:
            self.devices[index].follow_caller()
        if len(by_device) == 1:
            try:
                for job in state.jobs:
                    with span(f"issue {job.kind.value} {job.start}:{job.stop}"):
                        self._run_job(job, state)
            except BaseException as e:
                state.fail(e)
        else:
            threads = [
                threading.Thread(target=self._worker, args=(jobs, state), name=f"rptrain-device{d}", daemon=True)
                for d, jobs in by_device.items()
            ]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(timeout=0.5)
        with span("wait_devices"):
            for index in by_device:
                self.devices[index].synchronize()
        if state.error is not None:
            raise state.error
        if self.reducer is not None:
            self.reducer.finish()
            for index in by_device:
                self.devices[index].synchronize()
        for dst, src in state.deferred_adds:
            dst.add_(src)

    def _worker(self, jobs: list[Job], state: PassState) -> None:
        try:
            for job in jobs:
                self._run_job(job, state)
        except BaseException as e:  # re-raised by run() in the caller's thread
            state.fail(e)

    def _shell(self, device: Device, layer: int) -> Shell:
        key = (device.index, layer)
        if key not in self._shells:
            self._shells[key] = Shell(self.layers[layer], self.host.params, self.host.frozen_layout, self.host.buffer_layout, layer)
        return self._shells[key]

    # ----------------------------------------------------------------------------- tensors of a job
    def _stage_weights(self, device: Device, job: Job, version: int) -> tuple[StageTensors, StageTensors]:
        return self._weights(device, job, version), self._frozen(device, job)

    def _frozen(self, device: Device, job: Job) -> StageTensors:
        """The stage's frozen weights: the host copy itself on a CPU, uploaded once per GPU when the
        model stays resident (always the same memory, for CUDA graphs), else with every job."""
        layout = self.host.frozen_layout
        if not device.is_cuda:
            return StageTensors(layout, [(Range(k, 0, t.numel()), t) for k, t in self.host.frozen.items()])
        if self.resident:
            with self._resident_lock:
                found = self._resident_frozen.get(device.index)
                if found is None:
                    with device.stream("upload"):
                        pieces = [(Range(k, 0, t.numel()), device.upload(t)) for k, t in self.host.frozen.items()]
                        found = self._resident_frozen[device.index] = StageTensors(layout, pieces, device.record("upload"))
                return found
        with device.stream("upload"):
            pieces = [(r, device.upload(self.host.frozen[r.key][r.start : r.stop])) for r in layout.ranges(job.start, job.stop)]
            return StageTensors(layout, pieces, device.record("upload"))

    def frozen_changed(self) -> None:
        """The host's frozen weights were overwritten (load_state_dict): rewrite the resident copies in place."""
        with self._resident_lock:
            for index, found in self._resident_frozen.items():
                device = self.devices[index]
                with device.stream("upload"):
                    for r, t in found.pieces:
                        t.copy_(self.host.frozen[r.key], non_blocking=True)
                    found.event = device.record("upload")

    def _weights(self, device: Device, job: Job, version: int) -> StageTensors:
        layout = self.host.params
        if not device.is_cuda:
            flats = self.host.compute[version % 2]
            return StageTensors(layout, [(Range(k, 0, t.numel()), t) for k, t in flats.items()])
        if self.resident:
            return self._live_weights(device, version)
        with device.stream("upload"):
            pieces = [(r, device.upload(self.host.compute_range(version, r))) for r in layout.ranges(job.start, job.stop)]
            return StageTensors(layout, pieces, device.record("upload"))

    def resident_copy(self, device: Device, version: int) -> StageTensors:
        """Compute copy ``version`` uploaded to ``device`` (the optimizer thread calls this as soon
        as it has written the version, so the upload overlaps the running call)."""
        with self._resident_lock:
            resident = self._resident.setdefault(device.index, _Resident())
            found = resident.staged.get(version)
            if found is None:
                with device.stream("upload"):
                    pieces = [
                        (Range(k, 0, t.numel()), device.upload(t)) for k, t in self.host.compute[version % 2].items()
                    ]
                    found = StageTensors(self.host.params, pieces, device.record("upload"))
                resident.publish(version, found)
            return found

    def _live_weights(self, device: Device, version: int) -> StageTensors:
        """The copy jobs read: always the same memory (CUDA graphs rely on it), refreshed from the
        upload slot when the version changes."""
        staged = self.resident_copy(device, version)
        resident = self._resident[device.index]
        if resident.live is None:
            resident.live = [(r, torch.empty_like(t)) for r, t in staged.pieces]
        if resident.live_version != version:
            with device.stream("compute"):
                device.wait("compute", staged.event)
                for (_, live), (_, t) in zip(resident.live, staged.pieces):
                    live.copy_(t)
                    device.keep_alive(t, "compute")
            resident.live_version = version
        return StageTensors(self.host.params, resident.live)

    def prefetch_resident(self, version: int) -> None:
        if self.resident:
            for device in self.devices:
                self.resident_copy(device, version)

    def stage_from_master(self, version: int) -> None:
        """Version ``version`` on every GPU, cast partly there from the master (refresh.py); the
        host compute copy gets only the host's share. Returns once the master may change again."""
        if self._refresh_plan is None:
            self._refresh_plan = refresh.split(self.host.params, self.host.master.dtype)
        staged = refresh.stage_version(self.host, self.devices, version, self._refresh_plan)
        with self._resident_lock:  # held only to publish: a running call looks up its own version here
            for index, (pieces, event) in staged.items():
                self._resident.setdefault(index, _Resident()).publish(version, StageTensors(self.host.params, pieces, event))

    def drop_resident(self) -> None:
        with self._resident_lock:
            self._resident.clear()
            self._resident_frozen.clear()
        self._static_buffers.clear()
        self._static_grads.clear()
        self._graphs.clear()

    def _buffers(self, device: Device, job: Job, scratch: bool, state: PassState, static: bool = False) -> StageTensors:
        layout = self.host.buffer_layout
        ranges = layout.ranges(job.start, job.stop)
        if not device.is_cuda:
            pieces = [(r, self.host.buffer_range(r)) for r in ranges]
            if scratch:  # a recompute must not update running statistics twice
                pieces = [(r, t.clone()) for r, t in pieces]
            return StageTensors(layout, pieces)
        with device.stream("upload"):
            for event in state.buffer_events:  # statistics written back by earlier jobs of this call
                device.wait("upload", event)
            if not static:
                pieces = [(r, device.upload(self.host.buffer_range(r))) for r in ranges]
            else:  # a recorded graph reads and updates these very tensors
                key = (device.index, job.start, job.stop)
                if key not in self._static_buffers:
                    self._static_buffers[key] = StageTensors(layout, [(r, device.upload(self.host.buffer_range(r))) for r in ranges])
                pieces = self._static_buffers[key].pieces
                for r, t in pieces:
                    t.copy_(self.host.buffer_range(r), non_blocking=True)
            return StageTensors(layout, pieces, device.record("upload"))

    def _grads(self, device: Device, job: Job, static: bool) -> StageTensors:
        """Zeroed gradient tensors for the job's stage; the same memory every call when a recorded
        graph accumulates into them (the call's end synchronizes, so the last download is done)."""
        layout = self.host.params
        ranges = layout.ranges(job.start, job.stop)
        key = (device.index, job.start, job.stop)
        if static and key in self._static_grads:
            grads = self._static_grads[key]
            for _, t in grads.pieces:
                t.zero_()
            return grads
        grads = StageTensors(layout, [(r, device.zeros(r.numel, layout.dtypes[r.key])) for r in ranges])
        if static:
            self._static_grads[key] = grads
        return grads

    # ----------------------------------------------------------------------------- one job
    def _run_job(self, job: Job, state: PassState) -> None:
        device = self.devices[job.device]
        weights, frozen = state.prefetched.pop(job.index, None) or self._stage_weights(device, job, state.version)
        following = state.next_on_device.get(job.index)
        if following is not None and device.is_cuda and not self.resident:
            state.prefetched[following.index] = self._stage_weights(device, following, state.version)
        graphed = (job.kind is JobKind.FUSED and self.cuda_graphs and self.resident and device.is_cuda and not state.profile
                   and worth_recording(sum(r.numel for r in self.host.params.ranges(job.start, job.stop))))
        buffers = self._buffers(device, job, scratch=job.kind is JobKind.BACKWARD, state=state, static=graphed)
        shells = [self._shell(device, i) for i in range(job.start, job.stop)]
        buffer_versions = None if graphed else _buffer_versions(shells)
        with device.stream("compute"):
            device.wait("compute", weights.event)
            device.wait("compute", frozen.event)
            device.wait("compute", buffers.event)
            grads = None if job.kind is JobKind.FORWARD else self._grads(device, job, static=graphed)
            if grads is not None and self.reducer is None:  # a reducer needs each stage's gradients in one call
                state.early_grads[job.index] = _EarlyGrads(self, device, job, grads, state, shells)
            # A replayed graph reads the static tensors directly: the shells are bound only when
            # something runs them (recording, eager layers), which saves a Python pass per layer.
            modules = _BoundOnUse(shells, weights, frozen, buffers, grads)
            if not graphed:
                modules.bind()
            start_mark = device.timer() if state.profile else None
            run = {JobKind.FORWARD: self._forward, JobKind.FUSED: self._fused, JobKind.BACKWARD: self._backward}[job.kind]
            if job.kind is JobKind.FUSED:  # one fused job per call, so no other thread touches this
                state.graphs = self._graphs.setdefault(device.index, StageGraphs(device.torch_device)) if graphed else None
                # Train/eval modes select the graph: read from the user's layers, as the shells mirror them.
                state.graph_modes = tuple(m.training for layer in self.layers[job.start : job.stop] for m in layer.modules()) if graphed else ()
            try:
                for micro in range(state.num_microbatch):
                    if job.index == 0:
                        value, event, source = state.first_inputs[micro], None, None
                    else:
                        value, event, source = state.chain.take(job.index - 1, micro)
                    value = device.receive(value, event, source)
                    if job.index == 0 and job.kind is not JobKind.BACKWARD:  # the call's inputs (not output gradients)
                        value = convert_inputs(value, self.memory_format)
                    result = run(job, modules, value, micro, state, device)
                    state.chain.put(job.index, micro, result, device.record("compute"), device)
                # Graph replays update statistics without bumping the tensors' version counters.
                buffers_changed = graphed or _buffer_versions(shells) != buffer_versions
            finally:
                modules.release()
            if state.profile:
                state.timings.append((job, device, start_mark, device.timer()))
            if grads is not None:
                early = state.early_grads.pop(job.index, None)
                self._send_grads(device, job, early.rest() if early else grads.pieces, state)
            if job.kind is not JobKind.BACKWARD and device.is_cuda and buffers_changed:
                self._send_buffers(device, buffers, state)
        for _, t in weights.pieces + frozen.pieces + buffers.pieces:
            device.keep_alive(t, "compute")

    def _run_layers(self, modules: list, job: Job, a: int, b: int, x: Any, micro: int, state: PassState, device: Device, saves: tuple = ()) -> Any:
        for i in range(a, b):
            if i in saves:
                if state.offload and device.is_cuda:  # GPU memory then bounds one layer, not the sequence
                    state.saved[(i, micro)] = (self._to_host(device, x), device.record("download"), None)
                else:
                    state.saved[(i, micro)] = (x, device.record("compute"), device)
                if state.preserve_rng:
                    state.rng[(i, micro)] = device.rng_state()
            with self._recompute_context(job, i, micro, state, device) as store:
                x = call_layer(modules[i - job.start], x)
            if store and job.kind is JobKind.FORWARD and (i, micro) in store:  # moved to the recomputing device later
                store[(i, micro)] = (store[(i, micro)], device.record("compute"), device)
        return x

    @contextlib.contextmanager
    def _recompute_context(self, job: Job, layer: int, micro: int, state: PassState, device: Device) -> Iterator[Optional[dict]]:
        """recompute.py's context for one layer call: forward stages save, backward stages read."""
        key = (layer, micro)
        if job.kind is JobKind.BACKWARD and key in state.recompute_data:
            data, event, source = state.recompute_data.pop(key)
            store = {key: device.receive(data, event, source)}
        else:
            store = state.recompute_data if job.kind is JobKind.FORWARD and state.recompute_follows else None
        with recompute.layer_call(store, key, job.kind is JobKind.BACKWARD):
            yield store

    def _forward(self, job: Job, modules: list, x: Any, micro: int, state: PassState, device: Device) -> Any:
        with torch.no_grad():
            out = self._run_layers(modules, job, job.start, job.stop, x, micro, state, device, job.checkpoints)
        if state.profile:
            state.activation_bytes[job.start] = max(state.activation_bytes.get(job.start, 0), sum(t.nbytes for t in iter_tensors(out)))
        if job.index == len(state.jobs) - 1:  # the call's output
            state.outputs[micro] = self._to_output(device, out, state)
        return out

    def _fused(self, job: Job, modules: list, x: Any, micro: int, state: PassState, device: Device) -> Any:
        needs_input_grad = job.index > 0 or state.input_requires_grad
        label = device.receive(state.labels[micro], None, None)
        with torch.enable_grad(), _SavedBytes(state, job.start, weights=modules) as counter:
            leaves = make_leaves(x, needs_input_grad)
            key = None if state.graphs is None else signature(leaves)
            if key is not None:
                key = (job.start, job.stop, state.graph_modes, key)
                out = state.graphs.run(key, modules, leaves, call_layer)
            else:
                out = self._run_layers(modules, job, job.start, job.stop, leaves, micro, state, device)
            with recording_scalers(state.scalers):
                loss = state.loss_fn(out, label)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
            counter.stop()
            if loss.requires_grad:
                with self._watch_grads(job, micro, state, eager=key is None or not state.graphs.replays(key)):
                    loss.backward()
        # A loss_fn that returns the graph's own output (``lambda out, _: out``) hands back memory the
        # next replay overwrites: the call then returned microbatch 1's loss twice (H200, bench/graph_frozen.py).
        state.losses[micro] = loss.detach().reshape(()) if key is None else loss.detach().reshape(()).clone()
        if state.want_outputs:
            # A graph's outputs live in memory its next replay overwrites: copy them first.
            keep = (lambda t: t.detach().clone()) if key is not None else Tensor.detach
            state.outputs[micro] = self._to_output(device, map_tensors(keep, out), state)
        if not needs_input_grad:
            return None
        # A graph returns input gradients in memory its next replay overwrites.
        grads = [t.grad if key is None or t.grad is None else t.grad.clone() for t in float_tensors(leaves)]
        if job.start == 0:
            state.input_grads[micro] = grads
        return grads

    def _backward(self, job: Job, modules: list, grads: Any, micro: int, state: PassState, device: Device) -> Any:
        with self._watch_grads(job, micro, state, eager=True):
            return self._backward_segments(job, modules, grads, micro, state, device)

    def _watch_grads(self, job: Job, micro: int, state: PassState, eager: bool) -> contextlib.AbstractContextManager:
        """During the last microbatch's eager backward, send each gradient home once it is final."""
        early = state.early_grads.get(job.index)
        return early.watching() if early is not None and eager and micro == state.num_microbatch - 1 else contextlib.nullcontext()

    def _backward_segments(self, job: Job, modules: list, grads: Any, micro: int, state: PassState, device: Device) -> Any:
        starts = job.checkpoints or (job.start,)
        segments = list(zip(starts, list(starts[1:]) + [job.stop]))
        for a, b in reversed(segments):
            saved, event, source = state.saved.pop((a, micro))
            x = device.receive(saved, event, source)
            needs_input_grad = a > 0 or state.input_requires_grad
            with torch.enable_grad(), device.replay_rng(state.rng.pop((a, micro), None)), _SavedBytes(state, a, weights=modules):
                leaves = make_leaves(x, needs_input_grad)
                out = self._run_layers(modules, job, a, b, leaves, micro, state, device)
                pairs = [(o, g) for o, g in zip(float_tensors(out), grads or ()) if g is not None and o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = [t.grad for t in float_tensors(leaves)] if needs_input_grad else None
        if job.start == 0:
            state.input_grads[micro] = grads
        return grads

    def _to_output(self, device: Device, value: Any, state: PassState) -> Any:
        target = state.output_device
        if not device.is_cuda or target == device.torch_device:
            return map_tensors(lambda t: t.to(target), value)
        return _download(device, value, lambda t: t.to(target, non_blocking=True))

    def _to_host(self, device: Device, value: Any) -> Any:
        """Copy to pinned host memory on the download stream (the caller records its event)."""

        def pinned(t: Tensor) -> Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        return _download(device, value, pinned)

    # ----------------------------------------------------------------------------- sending results home
    def _send_grads(self, device: Device, job: Job, pieces: list[tuple[Range, Tensor]], state: PassState) -> None:
        """Gradients to the open window's fp32 buffer: copied where it is still empty, else added."""
        buffer = state.grad_buffer
        layout = self.host.params
        if not pieces:
            return
        if state.scalers:  # a GradScaler scaled this call's loss: it needs the inf/NaN verdict
            for _, g in pieces:
                bad = ~torch.isfinite(g).all()
                previous = state.nonfinite.get(device.index)
                state.nonfinite[device.index] = bad if previous is None else previous | bad
        ready = device.record("compute")
        with device.stream("download"):
            device.wait("download", ready)
            converted = []
            for r, g in pieces:
                converted.append((r, g.float()))
                device.keep_alive(g, "download")

            def land(averaged: Optional[list[Tensor]] = None) -> None:
                pieces = converted if averaged is None else [(r, g) for (r, _), g in zip(converted, averaged)]
                with device.stream("download"):
                    for r, g32 in pieces:
                        with state.lock:
                            runs = _fresh_runs(layout, buffer, r)
                        for lo, hi, fresh in runs:
                            dst = buffer.flat[layout.base[r.key] + lo : layout.base[r.key] + hi]
                            src = g32[lo - r.start : hi - r.start]
                            if fresh:
                                device.copy_to_host(dst, src)
                            else:
                                staged = torch.empty(hi - lo, dtype=torch.float32, pin_memory=device.is_cuda)
                                device.copy_to_host(staged, src)
                                state.deferred_adds.append((dst, staged))

            if self.reducer is None:
                land()
            else:
                self.reducer.reduce(state.reduce_order[job.index], [g32 for _, g32 in converted], land, lambda: state.error is not None)

    def _send_buffers(self, device: Device, buffers: StageTensors, state: PassState) -> None:
        ready = device.record("compute")
        with device.stream("download"):
            device.wait("download", ready)
            for r, t in buffers.pieces:
                device.copy_to_host(self.host.buffer_range(r), t)
                device.keep_alive(t, "download")
            state.buffer_events.append(device.record("download"))


def _download(device: Device, value: Any, copy: Callable[[Tensor], Tensor]) -> Any:
    """``copy`` every tensor of ``value`` on the download stream, after the compute issued so far."""
    ready = device.record("compute")
    with device.stream("download"):
        device.wait("download", ready)

        def move(t: Tensor) -> Tensor:
            device.keep_alive(t, "download")
            return copy(t)

        return map_tensors(move, value)


class _EarlyGrads:
    """Sends each parameter's gradient home as soon as the last microbatch's backward has
    accumulated it, so the downloads overlap the rest of the backward instead of following the
    whole stage (3 B params in one stage: 12.8 GB of fp32 gradients, 0.23 s at 55 GB/s). Only
    eager autograd reports accumulations: a replayed CUDA graph sends everything at the end."""

    def __init__(self, executor: "Executor", device: Device, job: Job, grads: StageTensors, state: PassState, shells: list[Shell]):
        self.executor, self.device, self.job, self.grads, self.state, self.shells = executor, device, job, grads, state, shells
        self.sent: set[int] = set()
        self.pending: dict[int, int] = {}  # slot index -> its parameters autograd has yet to accumulate
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        params = [(p, slot) for shell in self.shells for p, slot in shell.params if slot.requires_grad and p.requires_grad]
        # A tied tensor has one parameter per layer using it: its gradient is final after the last.
        self.pending = {}
        for _, slot in params:
            self.pending[slot.index] = self.pending.get(slot.index, 0) + 1
        handles = [p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, slot)) for p, slot in params]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _accumulated(self, slot: Slot, _param: Tensor) -> None:
        with self.lock:  # autograd may run hooks on its own threads
            self.pending[slot.index] -= 1
            if self.pending[slot.index] > 0 or slot.index in self.sent:
                return
            self.sent.add(slot.index)
        piece = (Range(slot.key, slot.offset, slot.offset + slot.numel), self.grads.flat(slot))
        self.executor._send_grads(self.device, self.job, [piece], self.state)

    def rest(self) -> list[tuple[Range, Tensor]]:
        """The stage's gradient pieces minus what was already sent, as runs of adjacent slots."""
        if not self.sent:
            return self.grads.pieces
        layout = self.grads.layout
        out: list[tuple[Range, Tensor]] = []
        for r, t in self.grads.pieces:
            runs: list[list[int]] = []  # [start, stop) in the flat tensor
            for slot in layout.slots_in_range(r):
                if slot.index in self.sent:
                    continue
                if runs and layout.adjacent(runs[-1][1], slot):
                    runs[-1][1] = slot.offset + slot.numel
                else:
                    runs.append([slot.offset, slot.offset + slot.numel])
            out += [(Range(r.key, a, b), t[a - r.start : b - r.start]) for a, b in runs]
        return out


class _BoundOnUse:
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


def _buffer_versions(shells: list[Shell]) -> list[int]:
    """In-place updates (BatchNorm statistics) bump these counters."""
    return [b._version for s in shells for b, _ in s.buffers]


def _fresh_runs(layout: FlatLayout, buffer: GradBuffer, r: Range) -> list[tuple[int, int, bool]]:
    """Split range ``r`` into runs of slots that are empty (copy) or already hold gradients (add)."""
    runs: list[tuple[int, int, bool]] = []
    for slot in layout.slots_in_range(r):
        fresh = not buffer.written[slot.index]
        buffer.written[slot.index] = True
        if runs and runs[-1][2] == fresh and layout.adjacent(runs[-1][1], slot):
            runs[-1] = (runs[-1][0], slot.offset + slot.numel, fresh)
        else:
            runs.append((slot.offset, slot.offset + slot.numel, fresh))
    return runs


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

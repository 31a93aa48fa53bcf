"""Runs one call: lowers its jobs into actions (actions.py, cached per call shape) and interprets them.

Each action goes to one handler; the handlers ask the weight store (weights.py, resident.py) for
tensors, the compute functions (compute.py) for results and the gradient sink (grads.py) to send
gradients home. Uploads run on the upload stream while the previous job computes, gradients go
home on the download stream, events in between. Results pass between jobs through a mailbox keyed
by (job, microbatch) with the event that marks them ready, so devices never wait on a global
barrier. With one device the jobs run inline in the calling thread; with several, each device gets
a thread for the call.
"""
from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from . import compute, fusion
from .actions import Action, Facts, Lowered, Op, Sizes, lower_call
from .callpath import CallPath
from .compute import BoundOnUse, JobRun, buffer_versions
from .device import Device, resolved
from .graphs import StageGraphs
from .grads import GradSink, ReducingSink
from .host import GradBuffer, HostState
from .batching import map_tensors
from .memory_format import convert_inputs
from .passstate import PassState
from .replica import Shell
from .resident import ResidentStore
from .schedule import Job, JobKind
from .trace import span
from .tuning import Tuning
from .weights import HostStore, StreamedStore

_training = operator.attrgetter("training")

_COMPUTE: dict[Op, Callable] = {Op.FORWARD: compute.forward, Op.FUSED: compute.fused, Op.BACKWARD: compute.backward}


class Executor:
    def __init__(self, layers: Sequence[torch.nn.Module], host: HostState, devices: Sequence[Device], tuning: Tuning, *,
                 resident: bool = False, cuda_graphs: bool = False, reducer: Any = None,
                 memory_format: Optional[torch.memory_format] = None):
        """``resident``: keep the whole compute copy on every GPU; ``cuda_graphs``: replay fused stages
        as CUDA graphs (needs resident weights); ``reducer``: a GradReducer averaging gradients
        across processes; ``memory_format``: the layout of 4-D inputs (memory_format.py)."""
        self.layers, self.host, self.devices, self.tuning = layers, host, devices, tuning
        self.cuda = devices[0].is_cuda
        self.resident = resident and self.cuda
        self.cuda_graphs = cuda_graphs and self.cuda
        self.memory_format = memory_format
        self.store: HostStore = (ResidentStore(host, tuning, devices) if self.resident
                                 else StreamedStore(host, tuning) if self.cuda else HostStore(host, tuning))
        self.sink: GradSink = GradSink(host.params) if reducer is None else ReducingSink(host.params, reducer)
        self.reducing = reducer is not None
        self._shells: dict[tuple[int, int], Shell] = {}
        self._graphs: dict[int, StageGraphs] = {}
        self._stage_modules: dict[tuple[int, int], list[nn.Module]] = {}  # (start, stop) -> its layers' modules, walked once
        self._lowered: dict[tuple, tuple[Sequence[Job], list[Lowered], CallPath]] = {}  # (id(jobs), facts) -> (jobs, actions, path)
        self._whole: dict[int, Any] = {}  # device index -> its recorded whole calls (wholecall.py)
        self.ended: dict[int, Any] = {}  # device index -> how its newest call ended (Device.join_caller; None: waited for)
        self.step_events: dict[int, Any] = {}  # device index -> the newest step that ended without a wait (Device.step_event)
        self._handlers: dict[Op, Callable[[JobRun, Action, PassState], None]] = {
            Op.UPLOAD: self._bring, Op.BIND: self._bring, Op.PREFETCH: self._prefetch, Op.BUFFERS: self._buffers,
            Op.START: self._start, Op.FORWARD: self._compute, Op.FUSED: self._compute, Op.BACKWARD: self._compute, Op.CALL: self._whole_call,
            Op.SEND: self._send, Op.REDUCE: self._send, Op.WRITEBACK: self._write_back,
        }

    # ----------------------------------------------------------------------------- lowering
    def facts(self, num_microbatch: int, profile: bool, offload: bool) -> Facts:
        return Facts(self.cuda, self.resident, self.cuda_graphs, self.tuning.max_graph_params, self.reducing,
                     num_microbatch, profile, offload, self.tuning.whole_call_graphs)

    def sizes(self, start: int, stop: int) -> Sizes:
        host = self.host
        grads = sum(s.numel for s in host.params.slots_of(start, stop) if s.requires_grad) * 4
        params = sum(r.numel for r in host.params.ranges(start, stop))
        return Sizes(host.params.nbytes(start, stop) + host.frozen_layout.nbytes(start, stop),
                     host.buffer_layout.nbytes(start, stop), grads, params)

    def lower(self, jobs: Sequence[Job], facts: Facts) -> list[Lowered]:
        """The call's actions, lowered once per call shape: schedules are cached (schedule.py), so the
        same shape brings the same ``jobs`` object and a lookup costs one hash of ``facts``."""
        return self._lower_call(jobs, facts)[1]

    def call_path(self, jobs: Sequence[Job], facts: Facts) -> CallPath:
        """Whether the call replays as one graph, or why not (callpath.py)."""
        return self._lower_call(jobs, facts)[2]

    def whole_call_fallback(self) -> Optional[str]:
        """Why the newest whole-call-path call ran stage by stage (None: replayed, or none ran)."""
        return next((g.fallback for g in self._whole.values() if g.fallback), None)

    def whole_call_microbatches(self) -> Optional[str]:
        """How the newest recorded whole call runs its microbatches (fusion.py); None before one."""
        graphs = next(iter(self._whole.values()), None)
        return graphs.microbatches if graphs is not None else None

    def _lower_call(self, jobs: Sequence[Job], facts: Facts) -> tuple:
        key = (id(jobs), facts)
        found = self._lowered.get(key)
        if found is None or found[0] is not jobs:
            if len(self._lowered) > 256:  # schedules evicted from their cache come back as new objects
                self._lowered.clear()
            found = self._lowered[key] = (jobs, *lower_call(jobs, facts, self.sizes))
        return found

    # ----------------------------------------------------------------------------- running a call
    def run(self, state: PassState) -> None:
        lowered = self.lower(state.jobs, self.facts(state.num_microbatch, state.profile, state.offload))
        by_device: dict[int, list[Lowered]] = {}
        for item in lowered:
            by_device.setdefault(item.job.device, []).append(item)
        state.reduce_order = {j.index: k for k, j in enumerate(j for j in state.jobs if j.kind is not JobKind.FORWARD)}
        self.sink.begin(state)
        # A training call writes its window's buffer: it follows the step that last read that buffer, not the newest
        # step (which reads the other buffer, and overlaps this call). With one version the master is the weights.
        buffer = None if self.host.single_version else state.grad_buffer
        steps = buffer.stepped if buffer is not None else self.step_events
        for index in by_device:
            self.devices[index].follow_caller()
            self.devices[index].follow_step(steps.get(index))
        if len(by_device) == 1:
            try:
                for item in lowered:
                    with span(f"issue {item.job.kind.value} {item.job.start}:{item.job.stop}"):
                        self._run_job(item, state)
            except BaseException as e:
                state.fail(e)
        else:
            threads = [threading.Thread(target=self._worker, args=(items, state), name=f"rptrain-device{d}", daemon=True)
                       for d, items in by_device.items()]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(timeout=0.5)
        with span("wait_devices"):
            host_waits = self._host_waits(state, [self.devices[i] for i in by_device])
            for index in by_device:
                device = self.devices[index]
                if host_waits:
                    device.synchronize()
                self.ended[index] = None if host_waits else device.join_caller()
        if state.error is not None:
            raise state.error
        self.sink.finish(state, [self.devices[i] for i in by_device])

    def _host_waits(self, state: PassState, used: list[Device]) -> bool:
        """Whether the caller waits for the devices at the end of a call. It need not where the host reads
        nothing the call made: one GPU keeping every weight and gradient (resident, all state on the GPU),
        no GradScaler verdict, no profile, no offloaded activations, outputs left on the GPU. The caller's
        stream then only orders after the call's (issue 33: on the H100 that wait was ~5 of ResNet-34's 9.3
        ms a step, host issue and GPU work running one after the other)."""
        return (len(used) != 1 or self.reducing or not self.resident or state.error is not None or bool(state.scalers)
                or bool(state.deferred_adds) or state.profile or state.offload or self.host.host.total > 0
                or resolved(state.output_device) != used[0].torch_device)

    def _worker(self, items: list[Lowered], state: PassState) -> None:
        try:
            for item in items:
                self._run_job(item, state)
        except BaseException as e:  # re-raised by run() in the caller's thread
            state.fail(e)

    def _shell(self, device: Device, layer: int) -> Shell:
        key = (device.index, layer)
        if key not in self._shells:
            self._shells[key] = Shell(self.layers[layer], self.host.params, self.host.frozen_layout, self.host.buffer_layout, layer)
        return self._shells[key]

    def _run_job(self, item: Lowered, state: PassState) -> None:
        device = self.devices[item.job.device]
        run = JobRun(item, device, [self._shell(device, i) for i in range(item.job.start, item.job.stop)])
        handlers = self._handlers
        try:
            with device.stream("compute"):
                for action in item.actions:
                    handlers[action.op](run, action, state)
        finally:
            if run.modules is not None:
                run.modules.release()
        for tensors in (run.weights, run.frozen, run.buffers):
            for _, t in tensors.pieces:
                device.keep_alive(t, "compute")

    # ----------------------------------------------------------------------------- the actions
    def _bring(self, run: JobRun, action: Action, state: PassState) -> None:
        """UPLOAD or BIND: the stage's weights (prefetched by the job before it, or fetched now)."""
        found = state.prefetched.pop(run.job.index, None)
        run.weights, run.frozen = found or self.store.weights(run.device, run.job, state.version, state.step_front)

    def _prefetch(self, run: JobRun, action: Action, state: PassState) -> None:
        job = state.jobs[action.job]
        state.prefetched[job.index] = self.store.weights(run.device, job, state.version, state.step_front)

    def _buffers(self, run: JobRun, action: Action, state: PassState) -> None:
        job = run.job
        run.buffers = self.store.buffers(run.device, job, job.kind is JobKind.BACKWARD, run.lowered.graphed, state.buffer_events)

    def _start(self, run: JobRun, action: Action, state: PassState) -> None:
        """The compute stream waits for the stage's tensors; gradients are zeroed; modules bound."""
        device, job, graphed = run.device, run.job, run.lowered.graphed
        run.buffer_versions = None if graphed else buffer_versions(run.shells)
        device.wait("compute", run.weights.event)
        device.wait("compute", run.frozen.event)
        device.wait("compute", run.buffers.event)
        device.check_ready("compute", (t for _, t in run.weights.pieces + run.frozen.pieces + run.buffers.pieces))
        run.grads = None if job.kind is JobKind.FORWARD else self.store.grads(device, job, static=graphed)
        if run.grads is not None and run.lowered.early:
            run.early = self.sink.early(device, job, run.grads, state, run.shells)
        # A replayed graph reads the static tensors directly: the shells are bound only when
        # something runs them (recording, eager layers), which saves a Python pass per layer.
        run.modules = BoundOnUse(run.shells, run.weights, run.frozen, run.buffers, run.grads)
        if not graphed:
            run.modules.bind()
        run.start_mark = device.timer() if state.profile else None
        if graphed or job.kind is JobKind.FUSED:  # one graphed or fused job per call, so no other thread touches this
            state.graphs = self._graphs.setdefault(device.index, device.graphs(self.tuning)) if graphed else None
            # Train/eval modes select the graph: read from the user's layers, as the shells mirror them.
            # ... and a fused call's slices (fused_call.py): its BatchNorms run per slice inside the graph.
            state.graph_modes = (*map(_training, self._modules_of(job)), tuple(state.fused_sizes or ())) if graphed else ()

    def _modules_of(self, job: Job) -> list[nn.Module]:
        key = (job.start, job.stop)
        if key not in self._stage_modules:
            self._stage_modules[key] = [m for layer in self.layers[job.start : job.stop] for m in layer.modules()]
        return self._stage_modules[key]

    def _compute(self, run: JobRun, action: Action, state: PassState) -> None:
        """One microbatch through the stage, its result handed to the next job."""
        job, device, micro = run.job, run.device, action.micro
        if job.index == 0:
            value, event, source = state.first_inputs[micro], None, None
        else:
            value, event, source = state.chain.take(job.index - 1, micro)
        value = device.receive(value, event, source)
        if job.index == 0 and job.kind is not JobKind.BACKWARD:  # the call's inputs (not output gradients)
            value = convert_inputs(value, self.memory_format)
        with fusion.statistics_per_microbatch(list(run.modules), state.fused_sizes) if state.fused_sizes else contextlib.nullcontext():
            result = _COMPUTE[action.op](run, value, micro, state)
        state.chain.put(job.index, micro, result, device.record("compute"), device)
        if state.profile and micro == state.num_microbatch - 1:
            state.timings.append((job, device, run.start_mark, device.timer()))

    def _whole_call(self, run: JobRun, action: Action, state: PassState) -> None:
        """Every microbatch as one replayed graph (wholecall.py); a call it cannot hold runs stage by stage."""
        device = run.device
        graphs = self._whole.get(device.index) or self._whole.setdefault(device.index, device.whole_call_graphs(self.tuning))
        done = None
        if state.input_requires_grad:
            graphs.fallback, graphs.joined = "inputs need gradients", False
        else:
            inputs = [convert_inputs(map_tensors(Tensor.detach, device.receive(v, None, None)), self.memory_format) for v in state.first_inputs]
            labels = [device.receive(y, None, None) for y in state.labels]
            done = graphs.run(state.graph_modes, run.modules, inputs, labels, state.loss_fn, state.first_inputs)
        if done is None:
            for m in range(state.num_microbatch):
                self._compute(run, Action(action.device, Op.FUSED, action.job, micro=m), state)
            return
        state.scalers.update(done.scalers)
        for m, ((single, losses), out) in enumerate(zip(done.losses, done.outputs)):  # static memory: copied
            kept = [t.clone() for t in losses]
            state.losses[m] = kept[0] if single else kept
            if state.want_outputs:
                state.outputs[m] = compute.to_output(device, map_tensors(torch.clone, out), state)

    def _send(self, run: JobRun, action: Action, state: PassState) -> None:
        """SEND or REDUCE: what the early sends left of the stage's gradients."""
        self.sink.send(run.device, run.job, run.early.rest() if run.early else run.grads.pieces, state)

    def _write_back(self, run: JobRun, action: Action, state: PassState) -> None:
        """Changed buffers (BatchNorm statistics) home; graph replays change them without a version bump."""
        if run.buffer_versions is not None and buffer_versions(run.shells) == run.buffer_versions:
            return
        device = run.device
        ready = device.record("compute")
        with device.stream("download"):
            device.wait("download", ready)
            for r, t in run.buffers.pieces:
                device.copy_to_host(self.host.buffer_range(r), t)
                device.keep_alive(t, "download")
            state.buffer_events.append(device.record("download"))

    # ----------------------------------------------------------------------------- between calls
    def after_calls(self, ended: dict[int, Any]) -> contextlib.AbstractContextManager:
        """The optimizer thread's context for a step of the calls that ended as ``ended`` (``self.ended``
        when the step was submitted): its GPU work follows them, not the calls issued since."""
        stack = contextlib.ExitStack()
        for index, events in ended.items():
            stack.enter_context(self.devices[index].stepping(events))
        return stack

    def step_done(self, buffer: Optional[GradBuffer]) -> None:
        """On the optimizer thread, after a step's GPU work was issued on its stream (``after_calls``): the
        calls that write ``buffer`` next, and those that read the newest weights, wait for it on the GPU
        instead of the thread waiting for it."""
        self.step_events = {d.index: d.step_event() for d in self.devices}
        if buffer is not None:
            buffer.stepped = self.step_events

    def settle_steps(self) -> None:
        """Wait for the steps' GPU work (``step_done``): before the host reads or writes the master."""
        for device in self.devices:
            device.settle_steps()

    def publish(self, version: int) -> None:
        """After an optimizer step wrote the master: compute copy ``version`` where jobs read it."""
        self.store.publish(version)

    def drop(self) -> None:
        """Free device memory and let go of the process group (close)."""
        self.store.drop()
        self._graphs.clear()
        self._whole.clear()
        self.sink = GradSink(self.host.params)

"""The version/window protocol and the optimizer-thread task.

Versions of the weights are numbered in the order the optimizer thread writes them: every
``step()`` and every ``synchronize()`` writes one. After ``step(is_async=True)`` the next call uses
the weights written by the step before it (iteration k's gradient is computed at the weights after
max(k-1, 0) steps); after ``step(is_async=False)`` or ``synchronize()`` it uses the newest.

Gradients go to one of two fp32 buffers: the open window's. A step hands the window's buffer to
the optimizer thread (as the master parameters' ``.grad``) and the next call opens the other one,
so the next iteration's backward overlaps the optimizer step. A step that fails, or a step function
that keeps a ``.grad``, leaves the buffer ``held`` until the next step lets it go.

With a single version of the weights (host.py's ``single_version``) the master is the compute copy and
there is one gradient buffer, so every call uses the newest weights. ``step(is_async=False)`` waits for the
step. ``step(is_async=True)`` returns at once where the weights stream (``overlaps``). The next training
call then runs while the step does: each stage's upload waits for the step to have written that stage
(rptrain/optim/front.py). The call opens the gradient buffer at its first gradient, after the step.

A step's error is raised once the caller has waited for that step (a call using its version or a
later one, ``synchronize()``, a synchronous step, ``close()``), never because the thread happened
to finish first: which call reports it, and so which calls ran, does not depend on thread timing.
A step that failed after writing part of the master or an optimizer's state (step_guard.py) is
reported the same way; from then on every call but ``load_state_dict`` and ``close`` is refused.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from ..optim.assist import Assist, assisting
from ..optim.front import StepFront, tracking
from .executor import Executor
from .host import GradBuffer, HostState
from .scaler import step_context
from .step_guard import stepping, watch
from .trace import span
from .weights import StreamedStore
from .worker import TaskThread, Ticket


def _step_assist(host: HostState, executor: Executor) -> Optional[Assist]:
    """With one version of the weights the GPU waits while the host steps: it takes a share (rptrain/optim/assist.py)."""
    share, devices = executor.tuning.host_step_gpu_share, executor.devices
    if not host.single_version or share <= 0 or len(devices) != 1 or not devices[0].is_cuda:
        return None
    return Assist(devices[0].torch_device, share)


def calls_may_overlap_steps(host: HostState, executor: Executor) -> bool:
    """Whether an asynchronous step of this engine lets the next call run meanwhile (Versions.overlaps)."""
    return host.single_version and executor.tuning.step_overlap and type(executor.store) is StreamedStore


class Versions:
    def __init__(self, host: HostState, executor: Executor, thread: TaskThread, optimizer_ctx: Callable[[], Any]):
        """``optimizer_ctx``: the context step functions run in (``OptimizerCtx``)."""
        self.host, self.executor, self.thread, self.optimizer_ctx = host, executor, thread, optimizer_ctx
        self.tickets: dict[int, Ticket] = {}  # version -> the task writing it
        self.written = 0  # newest version submitted
        self.waited = 0  # newest version the caller has waited for: errors up to it are reported
        self.required = 0  # version the next call uses
        self.shown = 0  # version the user's model parameters point at
        self.last_step = 0  # version the newest step writes
        self.window = 0  # which gradient buffer the open window accumulates into
        self.window_open = False
        self.window_scalers: dict = {}  # GradScaler -> (scale used, an inf/NaN seen) in this window
        self.damage: dict[int, str] = {}  # version -> what its failed step had written (step_guard.py)
        self.damaged: Optional[str] = None  # reported damage: calls are refused until whole weights are loaded
        self.assist = _step_assist(host, executor)
        self.front: Optional[StepFront] = None  # the step the next training call may overlap (front.py)

    def step(self, step_fn: Callable[[], Any], is_async: bool) -> None:
        """Submit ``step_fn`` with the window's gradients bound, and do the bookkeeping."""
        self.end_front()
        buffer, scalers = self.close_window()
        ended = dict(self.executor.ended)  # the calls whose gradients it steps: its GPU work follows them
        front = StepFront(self.written + 1) if self.overlaps(is_async) else None
        version = self.submit(functools.partial(self.run_step, step_fn, buffer, scalers, ended, front))
        self.stepped(version, buffer, is_async, front)

    def overlaps(self, is_async: bool) -> bool:
        """Whether the next training call may run while this step does: one version (so the step writes the
        weights that call reads; several write another copy, overlapping anyway), asynchronous (the caller reads
        nothing of the master until that call), and weights uploaded per stage (each upload waits for its part)."""
        return is_async and calls_may_overlap_steps(self.host, self.executor)

    def end_front(self) -> None:
        """Wait for the step a call may have overlapped, on the GPU too; its error is raised here."""
        front, self.front = self.front, None
        if front is not None:
            self.wait(front.version)
            self.executor.settle_steps()

    def call_window(self) -> dict:
        """A training call's gradient buffer (PassState's fields): the open window's, or where the call overlaps
        the step that still reads it (``use(early=True)``), its opening at the call's first gradient."""
        if not self.call_overlaps():
            return dict(grad_buffer=self.open_window())
        return dict(step_front=self.front, open_grad_buffer=self.open_after_step)

    def call_overlaps(self) -> bool:
        """Whether the step writing the version the next call uses still may run (``front``)."""
        return self.front is not None and self.front.version == self.required

    def open_after_step(self) -> GradBuffer:
        self.end_front()
        return self.open_window()

    def end_call(self, state: Any, failed: bool) -> None:
        """After a training call: one that overlapped a step waits for it (the step's error is the call's) and
        opens the window even if no gradient did, as every other call does."""
        if state.open_grad_buffer is not None:
            self.end_front()
            if not failed:
                state.window()

    def synchronize(self) -> None:
        self.drain()
        version = self.submit(self.host_refresh)
        self.wait(version)
        self.required = self.last_step = version
        self.use()
        self.host.write_user_params()
        self.damaged = None  # reached past check() only by load_state_dict: the master is whole again

    def discard_window(self) -> None:
        """Forget the gradients accumulated since the last step (someone else has used them)."""
        if self.window_open:
            self.host.grads[self.window].reset()
        self.window_scalers = {}

    def wait_all(self) -> None:
        """Wait for queued optimizer work without raising its errors."""
        for ticket in list(self.tickets.values()):
            ticket.wait()
        self.executor.settle_steps()  # their GPU work too: whoever waits here may read the master next
        self.waited = self.written

    def open_buffer(self) -> Optional[GradBuffer]:
        """The open window's gradient buffer (None: no call since the last step)."""
        return self.host.grads[self.window] if self.window_open else None

    def observe(self, scalers: dict, found_inf: bool) -> None:
        """A call's GradScalers and whether its gradients had an inf/NaN: kept for the window's step."""
        for scaler, scale in scalers.items():
            scaler._observe(found_inf)
            _, earlier = self.window_scalers.get(scaler, (scale, False))
            self.window_scalers[scaler] = (scale, earlier or found_inf)

    def close_window(self) -> tuple[Optional[GradBuffer], dict]:
        """The open window's gradient buffer (None: no call since the last step) and scalers."""
        buffer = self.host.grads[self.window] if self.window_open else None
        scalers, self.window_scalers = self.window_scalers, {}
        self.window_open = False
        return buffer, scalers

    def stepped(self, version: int, buffer: Optional[GradBuffer], is_async: bool, front: Optional[StepFront] = None) -> None:
        """Bookkeeping after submitting the step that writes ``version``."""
        previous, self.last_step = self.last_step, version
        if front is not None:  # the next call uses the step's weights, reading each part once it is written
            self.front, self.required = front, version
        elif is_async and not self.host.single_version:  # one version: nothing may read the weights while a step writes them
            self.required = max(self.required, previous)
            if buffer is not None:
                self.window = 1 - self.window
        else:
            try:
                self.wait(version)
                self.executor.settle_steps()  # a synchronous step is done when it returns, on the GPU too
            finally:  # a failed step still wrote its version; the buffer its .grad holds stays out of use
                self.required = version
                if buffer is not None and not buffer.free.is_set() and not self.host.single_version:  # (one version: one buffer, released once free)
                    self.window = 1 - self.window

    def submit(self, task: Callable[[int], None]) -> int:
        version = self.claim()
        self.tickets[version] = self.thread.submit(functools.partial(task, version))
        return version

    def claim(self) -> int:
        self.written += 1
        return self.written

    def wait(self, version: int) -> None:
        ticket = self.tickets.get(version)
        if ticket is not None:
            ticket.wait()
        self.waited = max(self.waited, version)  # tasks run in order: every earlier one is done too
        self.raise_errors()

    def raise_errors(self) -> None:
        """The first unreported error of the steps waited for (tickets up to ``waited``)."""
        for version, ticket in sorted(self.tickets.items()):
            if version <= self.waited:
                del self.tickets[version]
                self.damaged = self.damage.pop(version, None) or self.damaged
                error, ticket.error = ticket.error, None  # reported once, also where engines share a ticket
                if error is not None:
                    damage = f"; {self.damaged}" if self.damaged else ""
                    raise RuntimeError(f"the optimizer step failed on the optimizer thread: {error!r}{damage}") from error

    def check(self, loading: bool = False) -> None:
        """Before a call: the errors it has waited for, then a refusal while the weights are a mix
        (``loading``: load_state_dict, which makes them whole)."""
        if stepping():
            raise RuntimeError("an engine call from inside a step function (engine.step runs it): return from it first; "
                               "a step function only steps optimizers, GradScalers and schedules")
        self.raise_errors()
        if self.damaged and not loading:
            raise RuntimeError(self.damaged)

    def drain(self) -> None:
        self.wait_all()
        self.raise_errors()

    def use(self, early: bool = False) -> int:
        """The version the next call reads, once written; ``early``: a training call (forward_backward) may
        start while the step writing it runs (``front``), its weights' uploads waiting for their parts."""
        version = self.required
        with span("wait_weights"):
            if early and self.call_overlaps():
                self.wait(version - 1)
            else:
                self.end_front()
                self.wait(version)
        if self.shown != version:
            self.host.show_version(version)
            self.shown = version
        return version

    # ----------------------------------------------------------------------------- the optimizer thread
    def run_step(self, step_fn: Callable[[], Any], buffer: Optional[GradBuffer], scalers: dict, ended: dict,
                 front: Optional[StepFront], version: int) -> None:
        try:
            with tracking(front):
                self._run_step(step_fn, buffer, scalers, ended, version)
        finally:
            if front is not None:  # last: a call overlapping the step reads what no part reported only now
                front.finish()

    def _run_step(self, step_fn: Callable[[], Any], buffer: Optional[GradBuffer], scalers: dict, ended: dict, version: int) -> None:
        # The master changes and its version is staged: resident.py's copy() waits.
        with self.host.master_lock, self.executor.after_calls(ended):
            try:
                with span("bind_grads"):
                    self.bind_master_grads(buffer)
                with step_context(scalers), self.optimizer_ctx(), assisting(self.assist), span("step_fn"), \
                        watch(self.host.master_params, self.damage, version):
                    step_fn()
            finally:
                if self.host.gpu is not None:  # the GPU share's kernels: done before its buffer is reused
                    self.finish_gpu_step(ended, buffer)
                if buffer is not None:
                    buffer.held = any(buffer.owns(p.grad) for p in self.host.master_params)
                    if not buffer.held:
                        buffer.free.set()
                with span("stage_from_master" if self.executor.resident else "write_compute_copy"):
                    self.executor.publish(version)

    def finish_gpu_step(self, ended: dict, buffer: Optional[GradBuffer]) -> None:
        """The GPU share's step must finish before its gradient buffer is written again and before the master
        is read. After calls that ended without a host wait (all state on the GPU), the step ran on the step
        stream after them: the next call's streams wait for it on the GPU (``Executor.step_done``) and this
        thread goes on, so the host issues the next call while the GPU steps. Otherwise the thread waits."""
        if ended and all(e is not None for e in ended.values()):
            self.executor.step_done(buffer)
        else:
            with span("finish_gpu_step"):
                self.host.gpu.wait_queued()

    def host_refresh(self, version: int) -> None:
        """Compute copy ``version`` := the master, whole on the host (and staged on resident GPUs)."""
        with span("write_compute_copy"):
            self.host.write_compute(version)
        with span("upload_resident"):
            self.executor.store.prefetch_version(version)

    def bind_master_grads(self, buffer: Optional[GradBuffer]) -> None:
        """Master ``.grad`` := views of ``buffer`` for every slot that got a gradient this window."""
        layout = self.host.params
        held = [b for b in self.host.grads if b is not buffer and b.held]
        for slot, p in zip(layout.slots, self.host.master_params):
            if not slot.requires_grad:
                continue
            if buffer is not None and buffer.written[slot.index]:
                view = buffer.views[slot.index]
                if p.grad is not None:
                    view.add_(p.grad)  # zero_grad() was not called: gradients keep accumulating
                p.grad = view
            elif any(b.owns(p.grad) for b in held):
                p.grad = p.grad.clone()  # keep the user's gradient but let its buffer go
        if held and self.host.gpu is not None:
            self.host.gpu.wait_queued()  # (rare: a step kept .grad) the clones are done before a call writes the buffer
        for b in held:
            b.held = False
            b.free.set()

    def release(self, buffer: GradBuffer) -> None:
        """Master gradients keep their values in their own memory; ``buffer`` is free again."""
        for p in self.host.master_params:
            if buffer.owns(p.grad):
                p.grad = p.grad.clone()
        buffer.held = False
        buffer.free.set()

    def open_window(self) -> GradBuffer:
        buffer = self.host.grad_buffer(self.window)
        if not self.window_open:
            while not buffer.free.wait(timeout=0.5):
                if all(t.done() for t in self.tickets.values()):  # no step left that would let it go (one failed holding it)
                    self.release(buffer)
            buffer.free.clear()
            buffer.reset()
            self.window_open = True
        return buffer

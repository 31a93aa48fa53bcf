"""RoundPipe: the user-facing engine object.

Master weights live on the host in ``optim_dtype``; two compute copies in the model's dtype let the
optimizer thread write version v+1 while a call reads version v. Versions are numbered in the
order the optimizer thread writes them: every ``step()`` and every ``synchronize()`` writes one.

Staleness: after ``step(is_async=True)`` the next call uses the weights written by the step before
it, so the gradient of iteration k is computed at the weights after max(k-1, 0) steps; after
``step(is_async=False)`` or ``synchronize()`` the next call uses the newest weights.

The wrapped model's parameters show the host compute copy. It is whole after ``synchronize()``; on GPUs
that keep the model resident a step writes only the host's share of it (refresh.py).

Gradients go to one of two fp32 buffers: the open window's. ``step()`` hands the window's buffer
to the optimizer thread (as the master parameters' ``.grad``) and the next call opens the other
one, so the next iteration's backward overlaps the optimizer step.
"""
from __future__ import annotations

import functools
import os
import threading
import weakref
from collections import namedtuple
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .batching import PackedData, merge_outputs, split_inputs, split_label
from .config import RoundPipeRunConfig, ResolvedRunConfig, resolve
from .device import make_devices
from .executor import Args, Executor, PassState, float_tensors
from .fit import Size, check_fit
from .host import GradBuffer, HostState
from .memory_format import check_memory_format
from .plan import ExecutePlan, LayerCost, plan_stages
from .recorded import run_recorded
from .scaler import register_step_queue, step_context
from .schedule import JobKind, forward_schedule, training_schedule
from .trace import span
from .worker import TaskThread, Ticket

_optimizer_ctx = threading.local()
IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class OptimizerCtx:
    """Inside this block ``RoundPipe.parameters()`` yields the master parameters an optimizer must own."""

    def __enter__(self) -> "OptimizerCtx":
        _optimizer_ctx.depth = getattr(_optimizer_ctx, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _optimizer_ctx.depth -= 1


def _in_optimizer_ctx() -> bool:
    return getattr(_optimizer_ctx, "depth", 0) > 0


def _same_storage(t: Optional[Tensor], flat: Tensor) -> bool:
    return t is not None and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


class RoundPipe(nn.Module):
    def __init__(
        self,
        model: nn.Sequential,
        optim_dtype: torch.dtype = torch.float32,
        model_run_config: Optional[RoundPipeRunConfig] = None,
        devices: Any = None,
        cuda_graphs: bool = True,
        process_group: Any = None,
        optimizer_threads: Optional[int] = None,
        *,
        name: Optional[str] = None,
        pin_model: str = "alloc",
        memory_format: Optional[torch.memory_format] = None,
        max_host_memory: Size = None,
        max_gpu_memory: Size = None,
    ):
        """``devices``: None (every GPU, else the CPU) or a list like ``["cuda:0", "cuda:1"]``.
        ``cuda_graphs``: replay the fused last stage as CUDA graphs when the whole model stays
        resident on the GPU and the stage has at most ``graphs.MAX_GRAPH_PARAMS`` parameters
        (layers that cannot be captured fall back to eager, with a warning).
        ``process_group``: a torch.distributed group to train data-parallel over: every rank
        runs this engine on its own data and gradients are averaged before each step (NCCL for
        GPU engines, gloo for CPU ones). BatchNorm statistics stay per rank, as in DDP with
        ``broadcast_buffers=False``.
        ``optimizer_threads``: OpenMP threads of the optimizer step. Default on GPU engines: one
        fewer than torch's, so the thread issuing GPU work keeps a core; a statically scheduled
        parallel loop that shares a core with it waits for its slowest thread.
        ``name``, ``pin_model``: the original library's; ``name`` is kept as ``.name``, host copies
        are always pinned with PyTorch's allocator on GPU engines (its "alloc").
        ``memory_format``: ``torch.channels_last`` converts 4-D inputs to channels-last on the
        device and stores 4-D weights (and so their gradients and state-dict tensors) channels-last,
        so convolutions run NHWC kernels (faster on recent GPUs; memory_format.py). None: as given.
        ``max_host_memory``, ``max_gpu_memory``: budgets in bytes (or "96GiB"); None: physical memory
        less a reserve, and the GPU's free memory. A model whose state does not fit raises
        ``DoesNotFit`` before anything is allocated (fit.py); ``.placement`` says where the state lives."""
        super().__init__()
        if pin_model not in ("alloc", "register", "off"):
            raise ValueError(f"pin_model must be 'alloc', 'register' or 'off', got {pin_model!r}")
        self.name = name
        if not isinstance(model, nn.Sequential):
            raise TypeError(f"RoundPipe needs an nn.Sequential (one element per pipeline layer), got {type(model).__name__}")
        if len(model) == 0:
            raise ValueError("RoundPipe needs a non-empty nn.Sequential")
        if not (isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point):
            raise TypeError(f"optim_dtype must be a floating-point torch.dtype, got {optim_dtype!r}")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        if model_run_config is not None and not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError(f"model_run_config must be a RoundPipeRunConfig, got {type(model_run_config).__name__}")
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.device.type != "cpu":
                raise ValueError(f"RoundPipe takes a model on the CPU; {name!r} is on {t.device}")
        self.model = model
        self._layers = list(model)
        self._run_config = model_run_config or RoundPipeRunConfig()
        if self._run_config.execute_plan is not None:
            self._run_config.execute_plan.check_layers(len(self._layers))
        self._devices = make_devices(devices)
        self._cuda = self._devices[0].is_cuda
        self._reducer = None
        if process_group is not None:
            from .reduce import GradReducer

            self._reducer = GradReducer(process_group)
        resident = False
        if self._cuda:
            # Small models stay on every GPU (uploaded once per version, not once per stage).
            cap = min(d.memory_cap() or 0 for d in self._devices)
            # Two versions of the trainable weights (upload slot and live copy), one of the frozen.
            weights = sum((2 if p.requires_grad else 1) * p.numel() * p.element_size() for p in model.parameters())
            resident = self._same_on_all_ranks(weights <= 0.2 * cap)
        self.placement = check_fit(self._layers, optim_dtype, self._devices, resident, max_host_memory, max_gpu_memory)
        memory_format = check_memory_format(memory_format)
        self._host = HostState(self._layers, optim_dtype, pin_memory=self._cuda, pin_master=resident,
                               channels_last=memory_format is torch.channels_last)
        self._executor = Executor(self._layers, self._host, self._devices)
        self._executor.resident = resident
        self._executor.cuda_graphs = self._cuda and cuda_graphs
        self._executor.memory_format = memory_format
        if self._reducer is not None:
            self._executor.reducer = self._reducer
            self._reducer.check_same(self._host.master, self._devices[0].torch_device)
        # Without a GPU the optimizer and the compute share the cores, and a second thread of
        # OpenMP work makes every small op pay a thread wake-up (3x slower on 2 cores): there
        # the step runs inline when submitted. The staleness rules are the same either way.
        inline = not self._cuda and os.environ.get("RPTRAIN_CPU_OPTIMIZER_THREAD") != "1"
        if optimizer_threads is not None and (not isinstance(optimizer_threads, int) or optimizer_threads < 1):
            raise ValueError(f"optimizer_threads must be a positive int, got {optimizer_threads!r}")
        if optimizer_threads is None and self._cuda:
            optimizer_threads = max(1, torch.get_num_threads() - 1)
        self._optimizer_thread = TaskThread(f"rptrain-optimizer-{id(self):x}", inline=inline, threads=optimizer_threads)
        weakref.finalize(self, self._optimizer_thread.close)
        register_step_queue(self)
        self._plan: Optional[ExecutePlan] = None
        self._costs: Optional[list[LayerCost]] = None  # measured by the first call on a GPU
        self._activation_bytes: Optional[dict[int, int]] = None  # measured: one microbatch's output per layer
        self._memory_cap = 0
        self._tickets: dict[int, Ticket] = {}  # version -> the task writing it
        self._written = 0  # newest version submitted
        self._required = 0  # version the next call uses
        self._shown = 0  # version the user's model parameters point at
        self._last_step_version = 0
        self._window = 0  # which gradient buffer the open window accumulates into
        self._window_open = False
        self._window_scalers: dict = {}

    # ----------------------------------------------------------------------------- nn.Module surface
    def __getattr__(self, name: str) -> Any:
        """Attributes RoundPipe lacks are read from the wrapped model."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None:
                raise
            return getattr(model, name)

    def _apply(self, fn: Callable, recurse: bool = True) -> "RoundPipe":
        raise RuntimeError("RoundPipe decides where weights live: do not call .to()/.cuda()/.half() on it; build the model in the dtype you want before wrapping it")

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Names as in the wrapped Sequential. Inside ``OptimizerCtx``: the master parameters (frozen
        ones are yielded as they are: they never get a gradient, so optimizers skip them)."""
        originals = self.model.named_parameters(prefix=prefix, remove_duplicate=remove_duplicate)
        if not _in_optimizer_ctx():
            yield from originals
            return
        master = {id(p): m for p, m in zip(self._host.user_params, self._host.master_params)}
        for name, p in originals:
            yield name, master.get(id(p), p)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def optim_named_parameters(self, prefix: str = "", remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The master parameters, named (what ``named_parameters()`` gives inside ``OptimizerCtx``)."""
        with OptimizerCtx():
            named = list(self.named_parameters(prefix=prefix, remove_duplicate=remove_duplicate))
        yield from named

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.optim_named_parameters():
            yield p

    @property
    def devices(self) -> list:
        return [d.torch_device for d in self._devices]

    def memory_report(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        """Host bytes this engine allocated, per kind: ``master``, ``grads``, ``compute`` (copies),
        ``frozen`` (requires_grad=False weights, stored once), ``buffers``, and ``optimizer`` (the
        state tensors of ``optimizer``, when given: it allocates them, not the engine), plus ``total``."""
        report = self._host.nbytes()
        if optimizer is not None:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor) and t.device.type == "cpu"}
            report["optimizer"] = sum(storages.values())
        report["total"] = sum(report.values())
        return report

    @property
    def plan(self) -> Optional[ExecutePlan]:
        """The plan the planner chose (None until the first training call has been measured)."""
        return self._plan

    # ----------------------------------------------------------------------------- calls
    def forward(self, *args: Any, run_config: Optional[RoundPipeRunConfig] = None,
                roundpipe_run_config: Optional[RoundPipeRunConfig] = None, **kwargs: Any) -> Any:
        """``roundpipe_run_config``: the original library's name for ``run_config``."""
        self._raise_step_errors()
        cfg = self._resolve(run_config or roundpipe_run_config)
        micro = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        plan = self._forward_plan(cfg)
        if cfg.requires_grad and torch.is_grad_enabled():
            return run_recorded(self, cfg, plan, micro)
        version = self._use_version()
        state = PassState(
            forward_schedule(plan, len(self._devices)), cfg.num_microbatch, [Args(a, k) for a, k in micro], version,
            output_device=cfg.output_device,
        )
        self._executor.run(state)
        return merge_outputs(state.outputs, cfg.merge_output)

    def forward_backward(
        self,
        input_args: Any = (),
        input_kwargs: Optional[dict] = None,
        label: Any = None,
        loss_fn: Callable = lambda outputs, label: outputs,
        return_outputs: bool = False,
        run_config: Optional[RoundPipeRunConfig] = None,
    ) -> Any:
        """Forward, ``loss_fn(outputs, label)`` and backward over every microbatch.

        Returns the sum of the microbatch losses (and the merged outputs if ``return_outputs``).
        Without ``loss_fn`` the model's output is the loss (the original library's default).
        Gradients accumulate in fp32 on the host until the next ``step()``.
        """
        self._raise_step_errors()
        args, kwargs = _check_inputs(input_args, input_kwargs)
        if not callable(loss_fn):
            raise TypeError("forward_backward needs loss_fn: a callable (outputs, label) -> scalar tensor")
        cfg = self._resolve(run_config)
        micro = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        labels = split_label(label, cfg.num_microbatch, cfg.split_label)
        plan, profile = self._training_plan(cfg)
        version = self._use_version()
        buffer = self._open_window()
        jobs = training_schedule(plan, len(self._devices), cfg.recompute_grain)
        inputs = [float_tensors(Args(a, k)) for a, k in micro]
        state = PassState(
            jobs, cfg.num_microbatch,
            [Args(a, k) for a, k in micro], version, labels=labels, loss_fn=loss_fn, grad_buffer=buffer,
            preserve_rng=cfg.preserve_rng_state, want_outputs=return_outputs, output_device=cfg.output_device,
            profile=profile, offload=self._offload(jobs, cfg.num_microbatch),
            input_requires_grad=torch.is_grad_enabled() and any(t.requires_grad for i in inputs for t in i),
            recompute_follows=True,
        )
        self._run_training_pass(state)
        if profile:
            self._plan_from(state)
        if state.input_requires_grad:  # e.g. an encoder's packed output: its backward runs now
            pairs = [(t, g) for i, grads in zip(inputs, state.input_grads) for t, g in zip(i, grads or ()) if t.requires_grad and g is not None]
            torch.autograd.backward([t for t, _ in pairs], [g.to(t.device) for t, g in pairs])
        losses = [loss.to(cfg.output_device) for loss in state.losses]
        loss = torch.stack(losses).sum()
        if return_outputs:
            return loss, merge_outputs(state.outputs, cfg.merge_output)
        return loss

    def _run_training_pass(self, state: PassState) -> None:
        try:
            with span("forward_backward"):
                self._executor.run(state)
        except BaseException as e:
            state.grad_buffer.reset()
            if hasattr(e, "add_note"):
                e.add_note("rptrain: the gradients accumulated since the last step() were discarded")
            raise
        found_inf = any(bool(flag) for flag in state.nonfinite.values())
        if self._reducer is not None and state.scalers:  # every rank must skip the same steps
            found_inf = self._reducer.any_flag(found_inf, self._devices[0].torch_device)
        for scaler, scale in state.scalers.items():
            scaler._observe(found_inf)
            _, earlier = self._window_scalers.get(scaler, (scale, False))
            self._window_scalers[scaler] = (scale, earlier or found_inf)

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """Run ``step_fn(*args, **kwargs)`` (e.g. ``scaler.step(opt); opt.zero_grad()``) on the
        optimizer thread with the gradients accumulated since the last step as the master
        parameters' ``.grad``; there ``parameters()`` gives the master parameters."""
        self._raise_step_errors()
        if not callable(step_fn):
            raise TypeError(f"step() needs a callable, got {type(step_fn).__name__}")
        buffer, scalers = self._close_window()
        version = self._submit(functools.partial(self._run_step, functools.partial(step_fn, *args, **kwargs), buffer, scalers))
        self._stepped(version, buffer, is_async)

    def _close_window(self) -> tuple[Optional[GradBuffer], dict]:
        """The open window's gradient buffer (None: no call since the last step) and scalers."""
        buffer = self._host.grads[self._window] if self._window_open else None
        scalers, self._window_scalers = self._window_scalers, {}
        self._window_open = False
        return buffer, scalers

    def _stepped(self, version: int, buffer: Optional[GradBuffer], is_async: bool) -> None:
        """Bookkeeping after submitting the step that writes ``version``."""
        previous, self._last_step_version = self._last_step_version, version
        if is_async:
            self._required = max(self._required, previous)
            if buffer is not None:
                self._window = 1 - self._window
        else:
            try:
                self._wait_version(version)
            finally:  # a failed step still wrote its version; the buffer its .grad holds stays out of use
                self._required = version
                if buffer is not None and not buffer.free.is_set():
                    self._window = 1 - self._window

    def synchronize(self) -> None:
        """Wait for queued steps and make the compute copy equal to the master copy."""
        self._drain()
        version = self._submit(self._host_refresh)
        self._wait_version(version)
        self._required = self._last_step_version = version
        self._use_version()
        self._show_grads()

    def _show_grads(self) -> None:
        """The wrapped model's ``.grad``: the gradients accumulated since the last step (in the
        parameter's dtype; the step still uses the fp32 sums), None where there are none."""
        buffer = self._host.grads[self._window] if self._window_open else None
        for slot, p in zip(self._host.params.slots, self._host.user_params):
            written = buffer is not None and buffer.written[slot.index]
            p.grad = buffer.views[slot.index].to(p.dtype, copy=True) if written else None

    def wait_for_steps(self) -> None:
        """Wait for queued optimizer work without raising its errors (GradScaler.update uses it)."""
        for ticket in list(self._tickets.values()):
            ticket.wait()

    def close(self) -> None:
        """Stop the optimizer thread and free device memory; the object is not usable afterwards.
        Raises the error of a step nobody has seen fail yet."""
        self.wait_for_steps()
        self._optimizer_thread.close()
        self._executor.drop_resident()
        # Let go of the process group: one still referenced when the interpreter exits is torn
        # down after torch's globals, and its threads abort the process (seen with gloo).
        self._reducer = self._executor.reducer = None
        self._raise_step_errors()

    # ----------------------------------------------------------------------------- state dicts
    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """Master weights (``optim_dtype``) and buffers under the wrapped Sequential's names."""
        self._drain()
        master = {id(p): m for p, m in zip(self._host.user_params, self._host.master_params)}
        return {k: master.get(id(t), t).detach() for k, t in self.model.state_dict(keep_vars=True).items()}

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> IncompatibleKeys:
        self._drain()
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict needs a dict, got {type(state_dict).__name__}")
        master = {id(p): m for p, m in zip(self._host.user_params, self._host.master_params)}
        targets = {k: master.get(id(t), t) for k, t in self.model.state_dict(keep_vars=True).items()}
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                           f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        for key, value in state_dict.items():
            if key in targets:
                if not isinstance(value, Tensor):
                    raise TypeError(f"load_state_dict: {key!r} is a {type(value).__name__}, expected a tensor")
                if value.shape != targets[key].shape:
                    raise ValueError(f"load_state_dict: {key!r} has shape {tuple(value.shape)}, the model expects {tuple(targets[key].shape)}")
        with torch.no_grad():
            for key, value in state_dict.items():
                if key in targets:
                    targets[key].copy_(value)
        self._executor.frozen_changed()
        self.synchronize()
        return IncompatibleKeys(missing, unexpected)

    # ----------------------------------------------------------------------------- versions
    def _submit(self, task: Callable[[int], None]) -> int:
        version = self._claim_version()
        self._tickets[version] = self._optimizer_thread.submit(functools.partial(task, version))
        return version

    def _claim_version(self) -> int:
        self._written += 1
        return self._written

    def _wait_version(self, version: int) -> None:
        ticket = self._tickets.get(version)
        if ticket is not None:
            ticket.wait()
            self._raise_step_errors()

    def _raise_step_errors(self) -> None:
        for version, ticket in sorted(self._tickets.items()):
            if ticket.done():
                del self._tickets[version]
                error, ticket.error = ticket.error, None  # reported once, also where engines share a ticket
                if error is not None:
                    raise RuntimeError(f"the optimizer step failed on the optimizer thread: {error!r}") from error

    def _drain(self) -> None:
        self.wait_for_steps()
        self._raise_step_errors()

    def _use_version(self) -> int:
        version = self._required
        with span("wait_weights"):
            self._wait_version(version)
        if self._shown != version:
            self._host.show_version(version)
            self._shown = version
        return version

    # ----------------------------------------------------------------------------- the optimizer thread
    def _run_step(self, step_fn: Callable[[], Any], buffer: Optional[GradBuffer], scalers: dict, version: int) -> None:
        try:
            with span("bind_grads"):
                self._bind_master_grads(buffer)
            with step_context(scalers), OptimizerCtx(), span("step_fn"):
                step_fn()
        finally:
            if buffer is not None:
                buffer.held = any(_same_storage(p.grad, buffer.flat) for p in self._host.master_params)
                if not buffer.held:
                    buffer.free.set()
            if self._executor.resident:
                try:
                    with span("stage_from_master"):
                        self._executor.stage_from_master(version)
                except BaseException:  # not staged: a call that needs it uploads it from the host copy
                    self._host.write_compute(version)
                    raise
            else:
                self._host_refresh(version)

    def _host_refresh(self, version: int) -> None:
        """Compute copy ``version`` := the master, whole on the host (and staged on resident GPUs)."""
        with span("write_compute_copy"):
            self._host.write_compute(version)
        with span("upload_resident"):
            self._executor.prefetch_resident(version)

    def _bind_master_grads(self, buffer: Optional[GradBuffer]) -> None:
        """Master ``.grad`` := views of ``buffer`` for every slot that got a gradient this window."""
        layout = self._host.params
        held = [b for b in self._host.grads if b is not buffer and getattr(b, "held", False)]
        for slot, p in zip(layout.slots, self._host.master_params):
            if not slot.requires_grad:
                continue
            if buffer is not None and buffer.written[slot.index]:
                view = buffer.views[slot.index]
                if p.grad is not None:
                    view.add_(p.grad)  # zero_grad() was not called: gradients keep accumulating
                p.grad = view
            elif any(_same_storage(p.grad, b.flat) for b in held):
                p.grad = p.grad.clone()  # keep the user's gradient but let its buffer go
        for b in held:
            b.held = False
            b.free.set()

    def _release(self, buffer: GradBuffer) -> None:
        """Master gradients keep their values in their own memory; ``buffer`` is free again."""
        for p in self._host.master_params:
            if _same_storage(p.grad, buffer.flat):
                p.grad = p.grad.clone()
        buffer.held = False
        buffer.free.set()

    def _open_window(self) -> GradBuffer:
        buffer = self._host.grad_buffer(self._window)
        if not self._window_open:
            while not buffer.free.wait(timeout=0.5):
                self._raise_step_errors()
                if not self._tickets:  # no step left that would let it go (one failed holding it)
                    self._release(buffer)
            buffer.free.clear()
            buffer.reset()
            self._window_open = True
        return buffer

    # ----------------------------------------------------------------------------- plans
    def _resolve(self, run_config: Optional[RoundPipeRunConfig]) -> ResolvedRunConfig:
        cfg = resolve(self._run_config.override(run_config), len(self._devices) + 1 if self._cuda else 1)
        if cfg.execute_plan is not None:
            cfg.execute_plan.check_layers(len(self._layers))
        return cfg

    def _static_costs(self) -> list[LayerCost]:
        layout, frozen = self._host.params, self._host.frozen_layout
        costs = []
        for i in range(len(self._layers)):
            nbytes = layout.nbytes(i, i + 1) + frozen.nbytes(i, i + 1)
            grad_bytes = sum(s.numel * layout.dtypes[s.key].itemsize for s in layout.slots_of(i, i + 1))
            costs.append(LayerCost(nbytes, grad_bytes, float(nbytes + 1), 2.0 * (nbytes + 1)))
        return costs

    def _training_plan(self, cfg: ResolvedRunConfig) -> tuple[ExecutePlan, bool]:
        if cfg.execute_plan is not None:
            return cfg.execute_plan, False
        if self._plan is None:
            if self._cuda:  # measure every layer once (one layer per stage always fits), then plan
                return ExecutePlan.per_layer(len(self._layers)), True
            self._plan = plan_stages(self._static_costs(), len(self._devices))
        return self._plan, False

    def _auto_plan(self, min_stages: Optional[int], memory_cap: Optional[int]) -> ExecutePlan:
        """``ExecutePlan.auto``: the measured costs when a call has measured them, else the sizes."""
        cap = memory_cap or (min(d.memory_cap() or 0 for d in self._devices) or None)
        return plan_stages(self._costs or self._static_costs(), max(1, min_stages or len(self._devices)), cap)

    def _forward_plan(self, cfg: ResolvedRunConfig) -> ExecutePlan:
        if cfg.execute_plan is not None:
            return cfg.execute_plan
        if self._plan is None and not self._cuda:
            self._plan = plan_stages(self._static_costs(), len(self._devices))
        return self._plan or ExecutePlan.per_layer(len(self._layers))

    def _offload(self, jobs: list, num_microbatch: int) -> bool:
        """Move saved activations to the host when keeping them would take over a quarter of the GPU."""
        if not self._cuda or self._activation_bytes is None:
            return False
        saved = sum(self._activation_bytes.get(c - 1, 0) for job in jobs if job.kind is JobKind.FORWARD for c in job.checkpoints)
        return saved * num_microbatch > 0.25 * self._memory_cap

    def _plan_from(self, state: PassState) -> None:
        """Turn a measured one-layer-per-stage call into layer costs and a plan."""
        forward: dict[int, float] = {}
        backward: dict[int, float] = {}
        for job, device, start, stop in state.timings:
            seconds = device.elapsed(start, stop)
            if job.kind is JobKind.FORWARD:
                forward[job.start] = seconds
            elif job.kind is JobKind.FUSED:
                forward[job.start], backward[job.start] = seconds / 3, 2 * seconds / 3
            else:
                backward[job.start] = seconds
        base = self._static_costs()
        costs = [
            LayerCost(
                c.param_bytes, c.grad_bytes, forward.get(i, 0.0) + 1e-7,
                max(backward.get(i, 0.0) - forward.get(i, 0.0), 0.0) + 1e-7,
                state.activation_bytes.get(i, 0), state.saved_bytes.get(i, 0),
            )
            for i, c in enumerate(base)
        ]
        cap = min(d.memory_cap() or 0 for d in self._devices) or None
        self._costs = costs
        self._plan = self._same_on_all_ranks(plan_stages(costs, len(self._devices), cap))
        self._activation_bytes, self._memory_cap = dict(state.activation_bytes), cap or 0

    def _same_on_all_ranks(self, value: Any) -> Any:
        """Rank 0's decision everywhere: plans fix the order of the gradient collectives."""
        return value if self._reducer is None else self._reducer.broadcast_object(value)


def _check_inputs(input_args: Any, input_kwargs: Optional[dict]) -> tuple[tuple, dict]:
    if isinstance(input_args, Tensor):
        input_args = (input_args,)
    if not isinstance(input_args, (tuple, list)):
        raise TypeError(f"input_args must be a tuple of the first layer's positional inputs, got {type(input_args).__name__}")
    if input_kwargs is None:
        input_kwargs = {}
    if not isinstance(input_kwargs, dict):
        raise TypeError(f"input_kwargs must be a dict, got {type(input_kwargs).__name__}")
    if not any(isinstance(leaf, (Tensor, PackedData)) for leaf in pytree.tree_leaves((input_args, input_kwargs))):
        raise ValueError("forward_backward got no input tensors")
    return tuple(input_args), dict(input_kwargs)

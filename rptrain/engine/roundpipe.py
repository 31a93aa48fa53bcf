"""RoundPipe: the user-facing engine object.

Master weights (``optim_dtype``) live on the host (host.py), the leading layers' on a resident GPU
(gpushare.py); the optimizer thread writes new versions of the compute copy while calls read the
previous one (versions.py: which version a call uses, where its gradients go). Calls are planned
(planning.py), scheduled (schedule.py), lowered into actions and run (executor.py). The wrapped
model's parameters show the compute copy: the host's, or a resident GPU's (host.py, resident.py).
"""
from __future__ import annotations

import functools
import weakref
from collections import namedtuple
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .batching import merge_outputs, split_inputs, split_label
from .checks import check_args, check_inputs, check_state_dict
from .config import RoundPipeRunConfig, ResolvedRunConfig, resolve
from .device import make_devices
from .executor import Executor
from ..optim.state import OptimizerMemory, state_memory_of
from .fit import Size, check_fit, host_keeps_compute_copies
from .gpushare import gpu_state_allowed
from .passstate import Args, PassState, float_tensors
from .host import HostState
from .memory_format import check_memory_format
from .optimizer_ctx import OptimizerCtx, in_optimizer_ctx
from .plan import ExecutePlan
from .planning import Planner, same_on_all_ranks
from .recorded import run_recorded
from .scaler import register_step_queue
from .schedule import forward_schedule, training_schedule
from .trace import span
from .tuning import Tuning
from .versions import Versions
from .worker import TaskThread

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class RoundPipe(nn.Module):
    """One pipelined ``nn.Sequential``. Arguments:

    ``devices``: None (every GPU, else the CPU) or a list like ``["cuda:0", "cuda:1"]``.
    ``cuda_graphs``: replay the fused last stage as CUDA graphs when the whole model stays
    resident on the GPU and the stage has at most ``tuning.max_graph_params`` parameters
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
    ``tuning``: the engine's measured thresholds (tuning.py); None: the defaults.
    ``max_host_memory``, ``max_gpu_memory``: budgets in bytes (or "96GiB"); None: physical memory
    less a reserve, and the GPU's free memory. A model whose state does not fit raises
    ``DoesNotFit`` before anything is allocated (fit.py); ``.placement`` says where the state lives.
    ``gpu_state``: the leading layers' master, gradients and optimizer state on the GPU as far as they
    fit, stepped there (one GPU, model resident: gpushare.py); False: everything on the host.
    ``optimizer``: the optimizer that will step the master (its class or import path, or its
    ``OptimizerMemory``: rptrain/optim/state.py), so the fit check counts its state; None: rptrain.optim.Adam."""

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
        tuning: Optional[Tuning] = None,
        max_host_memory: Size = None,
        max_gpu_memory: Size = None,
        gpu_state: bool = True,
        optimizer: Any = None,
    ):
        super().__init__()
        check_args(model, optim_dtype, model_run_config, cuda_graphs, pin_model, tuning, optimizer_threads)
        self.name = name
        self._single = False  # wrap.py made this engine around one module: its names drop the "0."
        self._tuning = tuning or Tuning()
        self.model = model
        self._layers = list(model)
        self._run_config = model_run_config or RoundPipeRunConfig()
        if self._run_config.execute_plan is not None:
            self._run_config.execute_plan.check_layers(len(self._layers))
        self._devices = make_devices(devices)
        self._cuda = self._devices[0].is_cuda
        self._reducer = _reducer(process_group)
        resident = self._cuda and self._fits_resident(model, gpu_state)
        copies = host_keeps_compute_copies(resident, self._tuning.refresh_gpu_share)
        memory = optimizer if isinstance(optimizer, OptimizerMemory) else state_memory_of(optimizer, optim_dtype)
        self.placement = check_fit(self._layers, optim_dtype, self._devices, resident, max_host_memory, max_gpu_memory, self._tuning.pin_frozen_share,
                                   *gpu_state_allowed(gpu_state, self._devices, resident, self._tuning), compute_copies=copies, optimizer=memory)
        pins = self._devices[0].pins_memory
        memory_format = check_memory_format(memory_format)
        self._host = HostState(self._layers, optim_dtype, pin_memory=pins, pin_master=resident and pins,
                               pin_frozen_share=self._tuning.pin_frozen_share, channels_last=memory_format is torch.channels_last,
                               gpu_layers=self.placement.gpu_layers, gpu_device=self._devices[0], compute_copies=copies,
                               optimizer_bytes=memory.bytes_per_param)
        self._executor = Executor(self._layers, self._host, self._devices, self._tuning, resident=resident,
                                  cuda_graphs=cuda_graphs, reducer=self._reducer, memory_format=memory_format)
        if self._reducer is not None:
            self._reducer.check_same(self._host.master_sample(), self._devices[0].torch_device)
        self._planner = Planner(len(self._layers), self._host, self._devices, self._tuning, self._reducer)
        self._versions = Versions(self._host, self._executor, self._optimizer_thread(optimizer_threads), OptimizerCtx)
        register_step_queue(self)

    def _fits_resident(self, model: nn.Module, gpu_state: bool) -> bool:
        """Small models stay on every GPU (uploaded once per version, not per stage); larger with GPU state."""
        cap, tuning = min(d.memory_cap() or 0 for d in self._devices), self._tuning
        share = tuning.resident_share_gpu_state if gpu_state and len(self._devices) == 1 else tuning.resident_share
        # Two versions of the trainable weights (upload slot and live copy), one of the frozen.
        weights = sum((2 if p.requires_grad else 1) * p.numel() * p.element_size() for p in model.parameters())
        return same_on_all_ranks(self._reducer, weights <= share * cap)

    def _optimizer_thread(self, threads: Optional[int]) -> TaskThread:
        inline = not self._cuda and not self._tuning.cpu_optimizer_thread  # tuning.py says why
        if threads is None and self._cuda:
            threads = max(1, torch.get_num_threads() - 1)
        thread = TaskThread(f"rptrain-optimizer-{id(self):x}", inline=inline, threads=threads)
        weakref.finalize(self, thread.close)
        return thread

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
        if not in_optimizer_ctx():
            yield from originals
            return
        master = self._host.master_of()
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
        return self._host.report(optimizer)

    @property
    def plan(self) -> Optional[ExecutePlan]:
        """The plan the planner chose (None until the first training call has been measured)."""
        return self._planner.plan

    # ----------------------------------------------------------------------------- calls
    def forward(self, *args: Any, run_config: Optional[RoundPipeRunConfig] = None,
                roundpipe_run_config: Optional[RoundPipeRunConfig] = None, **kwargs: Any) -> Any:
        """``roundpipe_run_config``: the original library's name for ``run_config``."""
        self._versions.raise_errors()
        cfg = self._resolve(run_config or roundpipe_run_config)
        micro = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        plan = self._planner.forward(cfg)
        if cfg.requires_grad and torch.is_grad_enabled():
            return run_recorded(self, cfg, plan, micro)
        version = self._versions.use()
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
        self._versions.raise_errors()
        args, kwargs = check_inputs(input_args, input_kwargs)
        if not callable(loss_fn):
            raise TypeError("forward_backward needs loss_fn: a callable (outputs, label) -> scalar tensor")
        cfg = self._resolve(run_config)
        micro = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        labels = split_label(label, cfg.num_microbatch, cfg.split_label)
        plan, profile = self._planner.training(cfg)
        version = self._versions.use()
        buffer = self._versions.open_window()
        jobs = training_schedule(plan, len(self._devices), cfg.recompute_grain)
        inputs = [float_tensors(Args(a, k)) for a, k in micro]
        state = PassState(
            jobs, cfg.num_microbatch,
            [Args(a, k) for a, k in micro], version, labels=labels, loss_fn=loss_fn, grad_buffer=buffer,
            preserve_rng=cfg.preserve_rng_state, want_outputs=return_outputs, output_device=cfg.output_device,
            profile=profile, offload=self._planner.offload(jobs, cfg.num_microbatch),
            input_requires_grad=torch.is_grad_enabled() and any(t.requires_grad for i in inputs for t in i),
            recompute_follows=True,
        )
        self._run_training_pass(state)
        if profile:
            self._planner.measured(state)
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
        self._versions.observe(state.scalers, found_inf)

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """Run ``step_fn(*args, **kwargs)`` (e.g. ``scaler.step(opt); opt.zero_grad()``) on the
        optimizer thread with the gradients accumulated since the last step as the master
        parameters' ``.grad``; there ``parameters()`` gives the master parameters."""
        self._versions.raise_errors()
        if not callable(step_fn):
            raise TypeError(f"step() needs a callable, got {type(step_fn).__name__}")
        self._versions.step(functools.partial(step_fn, *args, **kwargs), is_async)

    def synchronize(self) -> None:
        """Wait for queued steps and make the compute copy equal to the master copy."""
        self._versions.synchronize()
        self._show_grads()

    def _show_grads(self) -> None:
        """The wrapped model's ``.grad``: the gradients accumulated since the last step (in the
        parameter's dtype; the step still uses the fp32 sums), None where there are none."""
        buffer = self._versions.open_buffer()
        for slot, p in zip(self._host.params.slots, self._host.user_params):
            written = buffer is not None and buffer.written[slot.index]
            p.grad = buffer.views[slot.index].to(p.device, p.dtype, copy=True) if written else None

    def wait_for_steps(self) -> None:
        """Wait for queued optimizer work without raising its errors (GradScaler.update uses it)."""
        self._versions.wait_all()

    def close(self) -> None:
        """Stop the optimizer thread and free device memory; the object is not usable afterwards.
        Raises the error of a step nobody has seen fail yet."""
        self.wait_for_steps()
        self._versions.thread.close()
        # Let go of the process group: one still referenced when the interpreter exits is torn
        # down after torch's globals, and its threads abort the process (seen with gloo).
        self._executor.drop()
        self._reducer = self._planner.reducer = None
        self._versions.raise_errors()

    def explain(self, *example_inputs: Any, **kwargs: Any) -> str:
        """The plan (stages, layers, devices, residency) and every device's actions, transfers with
        their bytes, of the next ``forward_backward(input_args=example_inputs, input_kwargs=kwargs)``,
        without running anything on a device (explain.py)."""
        from .explain import explain

        return explain(self, example_inputs, kwargs)

    # ----------------------------------------------------------------------------- state dicts
    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """Master weights (``optim_dtype``) and buffers under the wrapped Sequential's names."""
        self._versions.drain()
        master = self._host.master_of()
        return {k: master.get(id(t), t).detach().cpu() for k, t in self.model.state_dict(keep_vars=True).items()}

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> IncompatibleKeys:
        self._versions.drain()
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict needs a dict, got {type(state_dict).__name__}")
        master = self._host.master_of()
        targets = {k: master.get(id(t), t) for k, t in self.model.state_dict(keep_vars=True).items()}
        missing, unexpected = check_state_dict(state_dict, targets, strict)
        with torch.no_grad():
            for key, value in state_dict.items():
                if key in targets:
                    targets[key].copy_(value)
        self._executor.store.frozen_changed()
        self.synchronize()
        return IncompatibleKeys(missing, unexpected)

    # ----------------------------------------------------------------------------- plans
    def _resolve(self, run_config: Optional[RoundPipeRunConfig]) -> ResolvedRunConfig:
        cfg = resolve(self._run_config.override(run_config), len(self._devices) + 1 if self._cuda else 1)
        if cfg.execute_plan is not None:
            cfg.execute_plan.check_layers(len(self._layers))
        return cfg

    def _auto_plan(self, min_stages: Optional[int], memory_cap: Optional[int]) -> ExecutePlan:
        """``ExecutePlan.auto``: the measured costs when a call has measured them, else the sizes."""
        return self._planner.auto(min_stages, memory_cap)


def _reducer(process_group: Any) -> Any:
    if process_group is None:
        return None
    from .reduce import GradReducer

    return GradReducer(process_group)

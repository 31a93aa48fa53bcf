"""RoundPipe: the user-facing engine object.

Master weights (``optim_dtype``) live on the host (host.py), the leading layers' on a resident GPU
(gpushare.py); the optimizer thread writes new versions of the compute copy while calls read the
previous one (versions.py: which version a call uses, where its gradients go). Every call is
prepared in one place (prepare.py: run config, plan, schedule), lowered into actions and run
(executor.py). The wrapped model stays on the host, where the user put it: its parameters show the
host's compute copy, or where there is none the weights of the last ``synchronize()`` (host.py).
"""
from __future__ import annotations

import functools
import weakref
from collections import namedtuple
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .batching import merge_outputs, split_inputs, split_label, summed_losses
from .checks import check_args, check_inputs, check_state_dict
from .config import RoundPipeRunConfig, default_microbatches_for
from .device import make_devices
from .explain import explain
from .executor import Executor
from ..optim.state import OptimizerMemory, state_memory_of
from .fit import Size, claim_host, release_host
from .fused_call import CallFusion
from .forwarding import ForwardsAttributes
from .passstate import Args, PassState, float_tensors
from .host import HostState
from .memory_format import check_memory_format
from .optimizer_ctx import OptimizerCtx, in_optimizer_ctx
from .plan import ExecutePlan
from .planning import Planner
from .prefit import layers_of, placement_for
from .prepare import Preparer
from .recorded import run_recorded
from .reduce import make_reducer
from .scaler import register_step_queue
from .trace import span
from .tuning import Tuning
from .user_module import UserModule
from .versions import Versions, calls_may_overlap_steps
from .worker import TaskThread

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class RoundPipe(ForwardsAttributes):
    """One pipelined model: an ``nn.Sequential`` is split into its elements, any other module is one
    layer (the original library's rule). Arguments:

    ``devices``: None (every GPU, else the CPU) or a list like ``["cuda:0", "cuda:1"]``.
    ``cuda_graphs``: replay the fused last stage as CUDA graphs when the whole model stays
    resident on the GPU and the stage has at most ``tuning.max_graph_params`` parameters
    (layers that cannot be captured fall back to eager, with a warning).
    ``process_group``: a torch.distributed group to train data-parallel over (NCCL or gloo): gradients
    are averaged before each step; BatchNorm statistics stay per rank (DDP's ``broadcast_buffers=False``).
    ``optimizer_threads``: OpenMP threads of the optimizer step. Default on GPU engines: one fewer than torch's (torch's
    where one version's steps wait), so the issuing thread keeps a core (a static parallel loop waits for its slowest).
    ``name``: kept as ``.name``. ``pin_model`` (GPU engines): "alloc" pins host copies (large ones as exact registered
    mappings, small ones through PyTorch's allocator); "register" all at their exact size; "off" none (slower uploads).
    ``memory_format``: ``torch.channels_last`` converts 4-D inputs to channels-last on the
    device and stores 4-D weights (and so their gradients and state-dict tensors) channels-last,
    so convolutions run NHWC kernels (faster on recent GPUs; memory_format.py). None: as given.
    ``tuning``: the engine's measured thresholds (tuning.py); None: the defaults.
    ``max_host_memory``, ``max_gpu_memory``: budgets in bytes (or "96GiB"); None: physical memory
    less a reserve, and the GPU's free memory. A model whose state does not fit raises
    ``DoesNotFit`` before anything is allocated (fit.py); ``.placement`` says where the state lives.
    ``gpu_state``: the leading layers' master, gradients and optimizer state on the GPU as far as they
    fit, stepped there (one GPU, model resident or single version: gpushare.py); False: all on the host.
    ``keep_user_weights``: True (the original library's behaviour) keeps the wrapped module's weights on
    the host, written at ``synchronize()``, also where the engine itself keeps none there (resident GPUs);
    False lets those go (a model's size in the compute dtype of host memory) and leaves placeholders:
    read the weights through ``state_dict()`` (the CLI does).
    ``optimizer``: the optimizer that will step the master (its class or import path, or its
    ``OptimizerMemory``: rptrain/optim/state.py), so the fit check counts its state; None: rptrain.optim.Adam.
    ``materialise``: a meta-device model's layer ``i`` is made real by ``materialise(i)`` as it is copied in (host_fill.py).
    ``single_version``: True keeps one version of the weights (host.py: the master is the host's compute
    copy where their dtypes agree, one gradient buffer, a GPU share also while streaming): every call uses the
    newest weights; with ``Tuning.step_overlap`` (the default) ``step(is_async=True)`` returns at once and the next
    ``forward_backward`` reads each stage once the step wrote it (versions.py). False: two, as the original; None: two where they fit."""

    def __init__(
        self,
        model: nn.Module,
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
        gpu_state: bool = True, keep_user_weights: bool = True,
        optimizer: Any = None, materialise: Optional[Callable[[int], None]] = None, single_version: Optional[bool] = None,
    ):
        super().__init__()
        check_args(model, optim_dtype, model_run_config, cuda_graphs, pin_model, tuning, optimizer_threads, materialise, single_version)
        self.name = name
        self._tuning = tuning or Tuning()
        self.model = model
        self._layers = layers_of(model)
        self._run_config = model_run_config or RoundPipeRunConfig()
        self._devices = make_devices(devices)
        self._cuda = self._devices[0].is_cuda
        self._reducer = make_reducer(process_group)
        memory = optimizer if isinstance(optimizer, OptimizerMemory) else state_memory_of(optimizer, optim_dtype)
        resident, copies, self.placement, single = placement_for(self._layers, optim_dtype, self._devices, self._tuning, self._reducer,
                                                                 gpu_state, max_host_memory, max_gpu_memory, memory, single_version)
        pins = self._devices[0].pins_memory and pin_model != "off" and ("register" if pin_model == "register" else True)
        memory_format = check_memory_format(memory_format)
        self._host = HostState(self._layers, optim_dtype, pin_memory=pins, pin_master=resident and pins,
                               pin_frozen_share=self._tuning.pin_frozen_share, channels_last=memory_format is torch.channels_last,
                               gpu_layers=self.placement.gpu_layers, gpu_device=self._devices[0], compute_copies=copies,
                               optimizer_bytes=memory.bytes_per_param, keep_user_weights=keep_user_weights, materialise=materialise,
                               single_version=single)
        self._executor = Executor(self._layers, self._host, self._devices, self._tuning, resident=resident,
                                  cuda_graphs=cuda_graphs, reducer=self._reducer, memory_format=memory_format)
        if self._reducer is not None:
            self._reducer.check_same(self._host.master_sample(), self._devices[0].torch_device)
        self._planner = Planner(len(self._layers), self._host, self._devices, self._tuning, self._reducer, not resident)
        self._prepare = Preparer(self._run_config, len(self._layers), len(self._devices), self._cuda, self._planner)
        self._fusion = CallFusion(self._layers, self._tuning, self._cuda, len(self._devices), self._reducer is not None)
        self._versions = Versions(self._host, self._executor, self._optimizer_thread(optimizer_threads), OptimizerCtx)
        self._closed = False
        self._user = UserModule(self._host, self._versions)  # the wrapped module as its user sees it (user_module.py)
        register_step_queue(self)
        claim_host(self, self.placement.total("host"))  # engines made after this one fit against what it leaves
        self.keeps_user_weights = keep_user_weights
        self._initialized = True  # from here on, attributes RoundPipe lacks are the wrapped model's

    @staticmethod
    def default_num_microbatch(devices: Any = None) -> int:
        """``num_microbatch`` without a run config's: GPUs + 1, or 1 on the CPU (callers ask here, never count GPUs)."""
        return default_microbatches_for(devices)

    def _optimizer_thread(self, threads: Optional[int]) -> TaskThread:
        inline = not self._cuda and not self._tuning.cpu_optimizer_thread  # tuning.py says why
        if threads is None and self._cuda:  # one core kept for the issuing thread, idle only while a synchronous step runs
            waits = self._host.single_version and not calls_may_overlap_steps(self._host, self._executor)  # for every step
            threads = max(1, torch.get_num_threads() - (not waits))
        thread = TaskThread(f"rptrain-optimizer-{id(self):x}", inline=inline, threads=threads)
        weakref.finalize(self, thread.close)
        return thread

    # ----------------------------------------------------------------------------- nn.Module surface
    def _apply(self, fn: Callable, recurse: bool = True) -> "RoundPipe":  # .to(), .cuda(), .half(), ...
        raise RuntimeError("RoundPipe decides where weights live: do not call .to()/.cuda()/.half() on it; build the model in the dtype you want before wrapping it")

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped model's names; inside ``OptimizerCtx`` the master parameters (frozen ones as they are: no gradient)."""
        originals = self.model.named_parameters(prefix=prefix, remove_duplicate=remove_duplicate)
        if not in_optimizer_ctx():
            yield from originals
            return
        master = self._host.master_of()
        for name, p in originals:
            yield name, master.get(id(p), p)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        yield from (p for _, p in self.named_parameters())

    def optim_named_parameters(self, prefix: str = "", remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The master parameters, named (what ``named_parameters()`` gives inside ``OptimizerCtx``)."""
        with OptimizerCtx():
            return iter(list(self.named_parameters(prefix=prefix, remove_duplicate=remove_duplicate)))

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        yield from (p for _, p in self.optim_named_parameters())

    @property
    def devices(self) -> list:
        return [d.torch_device for d in self._devices]

    def memory_report(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        """Host bytes this engine allocated, per kind: ``master``, ``grads``, ``compute`` (copies), ``frozen``
        (requires_grad=False weights, once), ``buffers``, ``optimizer`` (``optimizer``'s state, when given), ``total``."""
        return self._host.report(optimizer)

    @property
    def plan(self) -> Optional[ExecutePlan]:
        """The plan the planner chose (None until the first training call has been measured)."""
        return self._planner.plan

    # ----------------------------------------------------------------------------- calls
    def forward(self, *args: Any, run_config: Optional[RoundPipeRunConfig] = None,
                roundpipe_run_config: Optional[RoundPipeRunConfig] = None, **kwargs: Any) -> Any:
        """``roundpipe_run_config``: the original library's name for ``run_config``."""
        self._check_open()
        call = self._prepare.forward(run_config or roundpipe_run_config)
        cfg = call.cfg
        micro = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        if call.recorded:
            return run_recorded(call, self._prepare.backward_jobs(call), micro, self._versions, self._executor, self._run_training_pass)
        version, parts = self._versions.use(), self._fusion.prepare_forward([Args(a, k) for a, k in micro])  # fused_call.py
        state = PassState(call.jobs, len(parts.inputs), parts.inputs, version, output_device=cfg.output_device, fused_sizes=parts.sizes)
        self._executor.run(state)
        return merge_outputs(parts.outputs_apart(state.outputs), cfg.merge_output)

    def forward_backward(self, input_args: Any = (), input_kwargs: Optional[dict] = None, label: Any = None,
                         loss_fn: Callable = lambda outputs, label: outputs, return_outputs: bool = False,
                         run_config: Optional[RoundPipeRunConfig] = None) -> Any:
        """Forward, ``loss_fn(outputs, label)`` and backward over every microbatch.

        Returns the sum of the microbatch losses (and the merged outputs if ``return_outputs``).
        ``loss_fn`` may return a sequence of scalar losses: each microbatch backpropagates all of them
        (``torch.autograd.backward``, as the original library) and the call returns their sums, a list.
        Without ``loss_fn`` the model's output is the loss (the original library's default).
        Gradients accumulate in fp32 on the host until the next ``step()``.
        """
        self._check_open()
        args, kwargs = check_inputs(input_args, input_kwargs)
        if not callable(loss_fn):
            raise TypeError("forward_backward needs loss_fn: a callable (outputs, label) -> scalar tensor")
        call = self._prepare.training(run_config)
        cfg = call.cfg
        micro = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        labels = split_label(label, cfg.num_microbatch, cfg.split_label)
        version, window = self._versions.use(early=True), self._versions.call_window()
        firsts = [Args(a, k) for a, k in micro]
        inputs = [float_tensors(a) for a in firsts]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for i in inputs for t in i)
        whole = lambda: self._executor.call_path(call.jobs, self._executor.facts(cfg.num_microbatch, call.profile, call.offload)).whole
        parts = self._fusion.prepare(firsts, labels, loss_fn, whole, needs_grad)  # as split, or as one batch (fused_call.py)
        state = PassState(
            call.jobs, len(parts.inputs), parts.inputs, version, labels=parts.labels, loss_fn=parts.loss_fn, **window,
            preserve_rng=cfg.preserve_rng_state, want_outputs=return_outputs, output_device=cfg.output_device,
            profile=call.profile, offload=call.offload, input_requires_grad=needs_grad, recompute_follows=True,
            fused_sizes=parts.sizes,
        )
        self._run_training_pass(state)
        if call.profile:
            self._planner.measured(state)
            self._fusion.apart = self._planner.keeps_apart
        if state.input_requires_grad:  # e.g. an encoder's packed output: its backward runs now
            pairs = [(t, g) for i, grads in zip(inputs, state.input_grads) for t, g in zip(i, grads or ()) if t.requires_grad and g is not None]
            torch.autograd.backward([t for t, _ in pairs], [g.to(t.device) for t, g in pairs])
        losses, outputs = parts.unfuse(state.losses, state.outputs)
        loss = summed_losses(losses, cfg.output_device)
        return (loss, merge_outputs(outputs, cfg.merge_output)) if return_outputs else loss

    def _run_training_pass(self, state: PassState) -> None:
        try:
            with span("forward_backward"):
                self._executor.run(state)
        except BaseException as e:
            if state.grad_buffer is not None:
                state.grad_buffer.reset()
            if hasattr(e, "add_note"):
                e.add_note("rptrain: the gradients accumulated since the last step() were discarded")
            self._versions.end_call(state, failed=True)  # (an overlapped step's error is raised instead, chained)
            raise
        self._versions.end_call(state, failed=False)
        found_inf = any(bool(flag) for flag in state.nonfinite.values())
        if self._reducer is not None and state.scalers:  # every rank must skip the same steps
            found_inf = self._reducer.any_flag(found_inf, self._devices[0].torch_device)
        self._versions.observe(state.scalers, found_inf)

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """Run ``step_fn(*args, **kwargs)`` (e.g. ``scaler.step(opt); opt.zero_grad()``) on the optimizer thread with
        the gradients accumulated since the last step as the master parameters' ``.grad`` (``parameters()`` there)."""
        self._check_open()
        if not callable(step_fn):
            raise TypeError(f"step() needs a callable, got {type(step_fn).__name__}")
        self._versions.step(functools.partial(step_fn, *args, **kwargs), is_async)

    def synchronize(self) -> None:
        """Wait for queued steps and make the compute copy (and the wrapped model's parameters) equal to the
        master; the gradients accumulated since the last step show as the parameters' ``.grad``. A user's own
        optimizer may then step those parameters (the original library's documented use): the next call
        takes them as the new weights and drops the gradients they used."""
        self._check_open()
        self._user.synchronize()

    def wait_for_steps(self) -> None:
        """Wait for queued optimizer work without raising its errors (GradScaler.update uses it)."""
        self._versions.wait_all()

    def close(self) -> None:
        """Stop the optimizer thread and free device memory (every later call but ``close()`` raises).
        Raises the error of a step nobody has seen fail yet."""
        if self._closed:
            return
        self._closed = True
        release_host(self)
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
        self._check_open()
        return explain(self._prepare.training(None), self._executor, self._planner, self.placement, example_inputs, kwargs, self._fusion.microbatches)

    def _check_open(self, loading: bool = False) -> None:
        """Refuse calls after ``close()``; else raise what a step that this call waits on reported (versions.py)."""
        if self._closed:
            raise RuntimeError(f"RoundPipe{f' {self.name!r}' if self.name else ''} was closed: make a new one to train or evaluate again")
        self._versions.check(loading)
        self._user.adopt_user_steps()

    # ----------------------------------------------------------------------------- state dicts
    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """Master weights (``optim_dtype``) and buffers under the wrapped model's names, on the host."""
        return {k: t.cpu() for k, t in self.master_state().items()}

    def master_state(self) -> dict[str, torch.Tensor]:
        """``state_dict()``'s tensors where they live, nothing copied (a GPU share's on its GPU): what a
        streaming writer reads a chunk at a time (checkpoints, exports) instead of a host copy of the share."""
        self._check_open()
        self._versions.drain()
        master = self._host.master_of()
        return {k: master.get(id(t), t).detach() for k, t in self.model.state_dict(keep_vars=True).items()}

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> IncompatibleKeys:
        self._check_open(loading=True)
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
        self._user.synchronize()
        return IncompatibleKeys(missing, unexpected)

    # ----------------------------------------------------------------------------- plans
    def _auto_plan(self, min_stages: Optional[int], memory_cap: Optional[int]) -> ExecutePlan:
        """``ExecutePlan.auto``: the measured costs when a call has measured them, else the sizes."""
        return self._planner.auto(min_stages, memory_cap)

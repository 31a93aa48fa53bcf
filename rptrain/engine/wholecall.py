"""A whole training call recorded as one CUDA graph and replayed (callpath.py says when).

Every microbatch's forward, ``loss_fn`` and backward are recorded once per call shape: the stage's
weights are the resident live copy, its buffers and gradient tensors static (resident.py), so a
replay reads and writes the same memory as the recording did, and the backward adds into the static
gradients that the SEND action then hands to the open window. The inputs and labels are copied into
the graph's static ones before each replay; the losses and outputs it returns live in memory the
next replay overwrites, so the caller copies them.

What the recording bakes in is part of the key: the train/eval modes, the inputs' and labels'
shapes and constants, autocast, and ``loss_fn`` (loss_key.py). Where every layer treats each sample by
itself, the microbatches run as one batch inside the recording (fusion.py). A ``GradScaler``'s
scale is read from a device tensor (scaler.py), refreshed before each replay, so a changed scale
needs no new recording. A call this cannot hold (inputs that need gradients, tensors the engine
cannot see, a ``loss_fn`` that reads tensor values on the host) returns None: the executor runs it
stage by stage, and ``fallback`` keeps the reason for ``explain()``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from . import fusion, rng
from .batching import iter_tensors, map_tensors, merge_outputs, opaque_type
from .compute import loss_scalars
from .graphs import WarmupUndo, signature
from .loss_key import closure_kept, loss_key
from .passstate import call_layer
from .scaler import recording_scalers, scaling_by_tensors
from .tuning import Tuning

# Recordings of one call shape and loss_fn code that differ only in what loss_fn closes over: past
# this, such a closure is taken to change every call (a per-batch divisor) and recording it is not
# worth its warm-up calls.
_CLOSURES_PER_CALL = 2


def _family(key: tuple) -> tuple:
    modes, parts, fn, autocast = key
    return (modes, parts, fn[:2], autocast)


def _autocast() -> tuple:
    return tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cuda", "cpu"))


@dataclass
class Recorded:
    """One recorded call: its static inputs, labels, losses and outputs, and the scalers it scales with."""

    graph: Any  # torch.cuda.CUDAGraph (None on a simulated device: replays run eagerly)
    inputs: list
    labels: list
    losses: list  # per microbatch: (whether loss_fn returned one tensor, its scalar losses)
    outputs: list
    factors: dict  # GradScaler -> its scale's device tensor
    filled: dict = field(default_factory=dict)  # GradScaler -> the scale the tensor holds
    keep: Any = None  # the loss_fn recorded: its closure's objects stay alive, so their ids stay theirs
    sizes: Optional[list] = None  # the microbatches' sizes where they run as one batch (fusion.py)


@dataclass
class Replayed:
    """What one replay gives the caller: each microbatch's losses, outputs (static memory) and the scales used."""

    losses: list
    outputs: list
    scalers: dict


def fill_scales(rec: Recorded) -> dict:
    """Each recorded scaler's current scale into its device tensor (only when it changed): the scales used."""
    scalers = {}
    for scaler, factor in rec.factors.items():
        scale = scaler.get_scale()
        if rec.filled.get(scaler) != scale:
            factor.fill_(scale)
            rec.filled[scaler] = scale
        scalers[scaler] = scale
    return scalers


def _copy_into(static: Any, value: Any) -> None:
    for s, t in zip(iter_tensors(static), iter_tensors(value)):
        if s.data_ptr() != t.data_ptr():
            s.copy_(t, non_blocking=True)


def _stage_forward(layers: list) -> Callable[[Any], Any]:
    def forward(x: Any) -> Any:
        for layer in layers:
            x = call_layer(layer, x)
        return x

    return forward


def run_call(modules: Iterable[nn.Module], inputs: list, labels: list, loss_fn: Callable, factors: dict, registry: dict,
             forward: Optional[Callable[[Any], Any]] = None, before_backward: Callable[[], None] = lambda: None,
             sizes: Optional[list] = None) -> tuple[list, list]:
    """Every microbatch's forward, loss and backward (the body a graph records); ``forward``: the
    stage's layers as one function (compiled: ``Tuning.compile_stages``), else they run one by one;
    ``before_backward``: called with the activations alive (a memory check); ``sizes``: the
    microbatches run as one batch (fusion.py), one backward for all their losses."""
    modules = list(modules)
    forward = forward or _stage_forward(modules)
    losses, outputs, pending = [], [], []
    with torch.enable_grad():
        if sizes is not None:
            with fusion.statistics_per_microbatch(modules, sizes):  # the inputs joined as the engine merges outputs
                parts = fusion.split(forward(merge_outputs(inputs)), sizes)
        for m, y in enumerate(labels):
            out = parts[m] if sizes is not None else forward(inputs[m])
            with recording_scalers(registry), scaling_by_tensors(factors):
                loss = loss_fn(out, y)
            items = loss_scalars(loss)
            pending += [t for t in items if t.requires_grad]  # as torch.autograd.backward(loss): every loss that needs it
            if sizes is None or m == len(labels) - 1:
                before_backward()
                if pending:
                    torch.autograd.backward(pending)
                pending = []
            losses.append((isinstance(loss, Tensor), [t.detach().reshape(()) for t in items]))
            outputs.append(map_tensors(Tensor.detach, out))
    return losses, outputs


class WholeCallGraphs:
    """Recorded whole calls on one device, by key; at most ``tuning.max_recorded_graphs`` of them."""

    def __init__(self, device: torch.device, tuning: Tuning):
        self.device, self.tuning = device, tuning
        self._recorded: dict[tuple, Optional[Recorded]] = {}
        self.fallback: Optional[str] = None  # why the newest call ran stage by stage (None: it replayed)
        self._failed: dict[tuple, str] = {}  # key -> why its recording failed
        self._pool = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._compiled: dict[tuple, Callable] = {}  # the layers' ids -> their forward, compiled once
        self.microbatches: Optional[str] = None  # how the newest recording runs its microbatches: as one batch, or why apart
        self.joined = False  # whether the newest call replayed a recording that runs its microbatches as one batch
        self._verdicts = fusion.Verdicts(tuning)

    def fused_sizes(self, layers: list, inputs: list, split: Optional[list]) -> Optional[list]:
        """The microbatches' sizes where the call may run them as one batch (fusion.py), else None
        (``microbatches`` says why). ``split``: the caller's microbatches before they were moved to the
        GPU, where ``fusion.cut_along_batch`` can still see that they are the batch cut along dimension 0."""
        if len(inputs) < 2:
            self.microbatches = "one"
            return None
        sizes, why = self._verdicts.sizes(layers, inputs, split)
        self.microbatches = "as one batch (fusion.py)" if why is None else f"apart: {why}"
        return sizes

    def _forward(self, layers: list) -> Optional[Callable[[Any], Any]]:
        """The stage compiled (``Tuning.compile_stages``; inductor, compiled by the first warm-up call and
        recorded inside the graph), else None: the layers run one by one."""
        if not self.tuning.compile_stages:
            return None
        key = tuple(map(id, layers))
        if key not in self._compiled:
            self._compiled[key] = torch.compile(_stage_forward(layers), backend="inductor" if self.device.type == "cuda" else "eager")
        return self._compiled[key]

    def run(self, modes: tuple, modules: Any, inputs: list, labels: list, loss_fn: Callable, split: Optional[list] = None) -> Optional[Replayed]:
        """Replay (recording first on a new key); None: run this call stage by stage (``fallback`` says why).
        ``modules``: the stage's modules, bound on iteration (only recording and eager replays need them);
        ``split``: as ``fused_sizes`` takes it (judged only when a call shape is recorded)."""
        key, why = self._key(modes, inputs, labels, loss_fn)
        if key is not None and key not in self._recorded:
            why = self._refusal(key)
            if why is not None:
                key = None
            else:
                self._recorded[key] = self._record(key, modules, inputs, labels, loss_fn, split)
        rec = self._recorded.get(key) if key is not None else None
        self.joined = rec is not None and rec.sizes is not None
        if rec is None:
            self.fallback = why or self._failed.get(key, "not recorded")
            return None
        self.fallback = None
        return self._replay(rec, modules, inputs, labels, loss_fn)

    def _refusal(self, key: tuple) -> Optional[str]:
        """Why a new key is not recorded: the recording limit, or a loss_fn whose closure changes every call."""
        if sum(r is not None for r in self._recorded.values()) >= self.tuning.max_recorded_graphs:
            why = f"{self.tuning.max_recorded_graphs} call shapes already recorded (Tuning.max_recorded_graphs)"
            warnings.warn(f"rptrain: {why}; new shapes run stage by stage", stacklevel=5)
            return why
        family = _family(key)  # the same shapes and loss_fn code, other closure values
        if sum(_family(k) == family for k in self._recorded) >= _CLOSURES_PER_CALL:
            return (f"loss_fn's closure changed in {_CLOSURES_PER_CALL} calls of the same shapes (say, a per-batch number): "
                    "calls with a changed closure run stage by stage")
        return None

    def _key(self, modes: tuple, inputs: list, labels: list, loss_fn: Callable) -> tuple[Optional[tuple], Optional[str]]:
        for value in (inputs, labels):
            if opaque_type(value) is not None:
                return None, "an input or label holds tensors the engine cannot see"
        parts = (signature(inputs), signature(labels))
        if None in parts:
            return None, "an input or label is not hashable"
        try:
            fn = loss_key(loss_fn)
            hash(fn)
        except TypeError:
            return None, "loss_fn's closure holds values that cannot be compared"
        return (modes, parts, fn, _autocast()), None

    def _replay(self, rec: Recorded, modules: Any, inputs: list, labels: list, loss_fn: Callable) -> Replayed:
        for static, value in zip(rec.inputs + rec.labels, inputs + labels):
            _copy_into(static, value)
        scalers = fill_scales(rec)
        rec.graph.replay()
        return Replayed(rec.losses, rec.outputs, scalers)

    def _record(self, key: tuple, modules: Any, inputs: list, labels: list, loss_fn: Callable, split: Optional[list]) -> Optional[Recorded]:
        layers = list(modules)
        undo = WarmupUndo(layers)
        rng = self._rng()
        try:
            with closure_kept(loss_fn):  # warm-ups and the recording leave the closure as it was
                return self._capture(layers, inputs, labels, loss_fn, self.fused_sizes(layers, inputs, split))
        except Exception as e:  # anything a graph cannot hold: this call shape runs stage by stage
            reason = self._failed[key] = f"recording the whole call failed: {type(e).__name__}: {e}"
            warnings.warn(f"rptrain: {reason}; running it stage by stage", stacklevel=5)
            return None
        finally:
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            undo.restore()  # the warm-up calls updated statistics and gradients
            self._set_rng(rng)

    def _memory_budget(self) -> float:
        return self.tuning.max_graph_memory_share * torch.cuda.get_device_properties(self.device).total_memory

    def _check_kept(self, start: int, budget: float) -> None:
        """A graph's activations live in its private pool (graphs.py says why that bounds them)."""
        kept = torch.cuda.memory_allocated(self.device) - start
        if kept > budget:
            raise MemoryError(f"a microbatch keeps {kept / 2**30:.2f} GiB for its backward, over Tuning.max_graph_memory_share "
                              f"({self.tuning.max_graph_memory_share:.0%} of the GPU)")

    def _rng(self) -> Tensor:
        return rng.get_state(self.device)

    def _set_rng(self, state: Tensor) -> None:
        rng.set_state(state, self.device)

    def _capture(self, layers: list, inputs: list, labels: list, loss_fn: Callable, sizes: Optional[list]) -> Recorded:
        static_in = [map_tensors(lambda t: t.detach().clone(), v) for v in inputs]
        static_labels = [map_tensors(lambda t: t.detach().clone(), v) for v in labels]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        factors: dict = {}
        forward = self._forward(layers)
        # One stream for the warm-up and the recording: autograd runs a node's backward on its forward's stream.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        start, budget = torch.cuda.memory_allocated(self.device), self._memory_budget()
        with torch.cuda.stream(self._stream):
            for _ in range(self.tuning.graph_warmup):  # cuDNN's algorithm search, compiling, lazy state, the scale tensors
                run_call(layers, static_in, static_labels, loss_fn, factors, {}, forward, lambda: self._check_kept(start, budget), sizes)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                losses, outputs = run_call(layers, static_in, static_labels, loss_fn, factors, {}, forward, sizes=sizes)
        return Recorded(graph, static_in, static_labels, losses, outputs, factors, {s: s.get_scale() for s in factors}, loss_fn, sizes)

"""A call's microbatches run as one batch, where that computes what running them apart computes.

A stage on one GPU runs a call's microbatches one after another. At the tutorial's size (ResNet-34,
two microbatches of 64) each kernel is too small to fill the GPU, so the two take 1.7x the time of one
microbatch of 128 (6.11 against 3.62 ms on an H100, bench/README.md). When every operation of the stage
treats each sample by itself, the microbatches' forward can run as one concatenated batch, each
microbatch's loss taken on its own slice of the outputs and one backward run for all of them: the
same losses, outputs and gradients up to the order of floating-point additions.

BatchNorm in training mode looks across samples: it runs once per microbatch slice (its own
statistics, its running statistics updated once per microbatch, in order), exactly as the
microbatches run apart. Which operations treat each sample by itself is read from each layer's
torch.fx graph and checked against the lists below; anything else (a layer fx cannot trace, a
function or module not listed, a view that could mix samples, dropout, which would draw its random
numbers in another order, a hook, which would see the microbatches together) keeps them apart, and
``why_not`` says why for ``explain()``.
"""
from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .batching import consecutive, iter_tensors

# Modules that treat each sample (dimension 0) by itself, whatever their settings below.
_PER_SAMPLE_MODULES = frozenset((
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear, nn.Identity,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.ELU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Softplus, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.LayerNorm, nn.GroupNorm, nn.Embedding, nn.ZeroPad2d, nn.ConstantPad2d, nn.Upsample, nn.PixelShuffle,
))  # exact types: a subclass may have a forward of its own
_BATCH_NORMS = frozenset((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))  # run once per microbatch slice
_DROPOUTS = frozenset((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout))  # per sample, drawing in another order

# Functions and tensor methods that treat each sample by itself (elementwise, or per sample by definition).
_PER_SAMPLE_FUNCTIONS = {
    operator.add, operator.iadd, operator.sub, operator.isub, operator.mul, operator.imul, operator.truediv,
    operator.itruediv, operator.neg, torch.add, torch.sub, torch.mul, torch.relu, torch.sigmoid, torch.tanh,
    F.relu, F.relu6, F.gelu, F.silu, F.leaky_relu, F.hardswish, F.sigmoid, F.tanh, F.avg_pool2d, F.max_pool2d,
    F.adaptive_avg_pool2d, F.conv2d, F.linear,
}
_PER_SAMPLE_METHODS = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "relu", "relu_", "sigmoid", "tanh", "clamp", "clamp_",
    "contiguous", "float", "half", "bfloat16",
}
# Functions and methods that treat each sample by itself when they work on a dimension after the batch's:
# the keyword naming that dimension (also the second argument, after the tensor) and its default.
_DIM_FROM_ONE = {torch.flatten: ("start_dim", 0), "flatten": ("start_dim", 0), torch.cat: ("dim", 0), torch.softmax: ("dim", None),
                 F.softmax: ("dim", None), F.log_softmax: ("dim", None), "softmax": ("dim", None), "log_softmax": ("dim", None)}


def why_not(layers: Sequence[nn.Module]) -> Optional[str]:
    """None when the layers may run a call's microbatches as one batch, else the first reason they may not."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks:
        return "a global module hook would see the microbatches together"
    for i, layer in enumerate(layers):
        why = _module_why_not(layer)
        if why is not None:
            return f"layer {i} ({type(layer).__name__}): {why}"
    return None


def _module_why_not(m: nn.Module) -> Optional[str]:
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return "a hook on it would see the microbatches together"
    if type(m) in _DROPOUTS:
        return "dropout would draw its random numbers in another order" if m.training and m.p > 0 else None
    if type(m) is nn.Flatten:
        return None if m.start_dim >= 1 else f"flattens from dimension {m.start_dim}"
    if type(m) in (nn.Softmax, nn.LogSoftmax):
        return None if isinstance(m.dim, int) and m.dim >= 1 else f"{type(m).__name__} over dimension {m.dim}"
    if type(m) in _PER_SAMPLE_MODULES or type(m) in _BATCH_NORMS:
        return None
    if type(m) is nn.Sequential:
        return why_not(list(m))
    if type(m).__module__.startswith("torch.nn"):
        return f"{type(m).__name__} is not known to treat each sample by itself"
    try:
        with _state_kept(m):
            graph = torch.fx.symbolic_trace(m).graph
    except Exception as e:  # data-dependent Python, a construct fx cannot follow
        return f"its forward cannot be traced ({type(e).__name__})"
    for node in graph.nodes:
        why = _node_why_not(m, node)
        if why is not None:
            return why
    return None


@contextlib.contextmanager
def _state_kept(m: nn.Module) -> Iterator[None]:
    """Tracing runs the forward's Python on stand-ins: a forward that caches something on first use (a
    rotary table, a mask) would keep a stand-in. Every module's attributes are put back afterwards."""
    saved = [(sub, {k: copy.copy(v) if isinstance(v, dict) else v for k, v in vars(sub).items()}) for sub in m.modules()]
    try:
        yield
    finally:
        for sub, attrs in saved:
            vars(sub).clear()
            vars(sub).update(attrs)


def _node_why_not(root: nn.Module, node: torch.fx.Node) -> Optional[str]:
    if node.op in ("placeholder", "output", "get_attr"):
        return None
    if node.op == "call_module":
        return _module_why_not(root.get_submodule(node.target))
    target = node.target if node.op == "call_function" else str(node.target)
    if target in _DIM_FROM_ONE:
        keyword, default = _DIM_FROM_ONE[target]
        dim = node.kwargs.get(keyword, node.args[1] if len(node.args) > 1 else default)
        return None if isinstance(dim, int) and dim >= 1 else f"{_name(target)} over dimension {dim}"
    known = _PER_SAMPLE_FUNCTIONS if node.op == "call_function" else _PER_SAMPLE_METHODS
    return None if target in known else f"{_name(target)} is not known to treat each sample by itself"


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def cut_along_batch(values: list) -> bool:
    """Whether each tensor of the microbatches is a run of consecutive dimension-0 slices of one tensor,
    as the automatic split cuts the batch: joining them gives the batch back. A tensor handed whole to
    every microbatch, or cut another way (a split_input function), is not."""
    columns = [list(iter_tensors(v)) for v in values]
    if len({len(c) for c in columns}) != 1:
        return False
    return all(consecutive(list(column)) for column in zip(*columns))


class Verdicts:
    """Whether a call's microbatches may run as one batch: the switches, the inputs' cut and the layers
    (each set of layers traced once per train/eval modes). The whole call (wholecall.py) and the other
    calls on one GPU (fused_call.py) ask here, so both decide alike."""

    def __init__(self, tuning: Any):
        self.tuning = tuning
        self._layers: dict[tuple, Optional[str]] = {}  # the layers' ids and modes -> why_not

    def sizes(self, layers: Sequence[nn.Module], inputs: list, split: Optional[list]) -> tuple[Optional[list[int]], Optional[str]]:
        """(the microbatches' sizes, None) where they may run as one batch, else (None, why not). ``inputs``:
        the microbatches as the layers get them; ``split``: as the caller's split made them, where
        ``cut_along_batch`` can still see the cut (None: unknown, so apart)."""
        if not self.tuning.fuse_microbatches:
            return None, "off (Tuning.fuse_microbatches=False)"
        if self.tuning.compile_stages:
            return None, "the stage is compiled (Tuning.compile_stages)"
        sizes = microbatch_sizes(inputs)
        if sizes is None or 0 in sizes or split is None or not cut_along_batch(split):
            return None, "the microbatches' inputs are not the batch cut along its first dimension"
        key = tuple((id(m), m.training) for layer in layers for m in layer.modules())
        if key not in self._layers:
            self._layers[key] = why_not(layers)
        why = self._layers[key]
        return (sizes, None) if why is None else (None, why)


def microbatch_sizes(inputs: list) -> Optional[list[int]]:
    """Each microbatch's size (dimension 0 of every tensor it holds), or None where a microbatch's
    tensors disagree on it or one has none."""
    out = []
    for value in inputs:
        dims = {t.shape[0] if t.dim() else None for t in iter_tensors(value)}
        if len(dims) != 1 or None in dims:
            return None
        out.append(dims.pop())
    return out


@contextlib.contextmanager
def statistics_per_microbatch(layers: Sequence[nn.Module], sizes: Sequence[int]) -> Iterator[None]:
    """Inside: each BatchNorm of ``layers`` normalises each microbatch slice of its input by itself (its
    own forward, once per slice, in order), as the microbatches would run apart."""
    norms = [m for layer in layers for m in layer.modules()
             if type(m) in _BATCH_NORMS and (m.training or m.running_mean is None)]  # those using the batch's statistics
    for bn in norms:
        bn.forward = _sliced(type(bn).forward.__get__(bn), list(sizes))
    try:
        yield
    finally:
        for bn in norms:
            del bn.forward


def _sliced(forward: Any, sizes: list[int]) -> Any:
    def run(x: Tensor) -> Tensor:
        return torch.cat([forward(part) for part in x.split(sizes)])

    return run


def split(value: Any, sizes: Sequence[int]) -> list:
    """``value``'s tensors cut along dimension 0 into microbatches of ``sizes`` (views); a tensor whose
    first dimension is not their sum cannot be cut (ValueError: the call runs stage by stage)."""
    leaves, spec = pytree.tree_flatten(value)
    parts = []
    for leaf in leaves:
        if not isinstance(leaf, Tensor):
            parts.append([leaf] * len(sizes))
        elif leaf.dim() and leaf.shape[0] == sum(sizes):
            parts.append(leaf.split(list(sizes)))
        else:
            raise ValueError(f"a stage output of shape {tuple(leaf.shape)} has no batch dimension of {sum(sizes)} to cut")
    return [pytree.tree_unflatten(list(column), spec) for column in zip(*parts)] if parts else [value] * len(sizes)

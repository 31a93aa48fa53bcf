"""What one call's jobs share (``PassState``) and the small types passed between them."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .batching import iter_tensors, map_tensors, opaque_type
from .device import Device
from .host import GradBuffer
from .schedule import Job

if TYPE_CHECKING:
    from .graphs import StageGraphs
    from ..optim.front import StepFront


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
    # A call overlapping the step that writes its weights (versions.py): what that step has finished, and the
    # gradient buffer's opening, deferred to the first gradient (the step reads the buffer until it ends).
    step_front: Optional[StepFront] = None
    open_grad_buffer: Optional[Callable[[], GradBuffer]] = None
    preserve_rng: bool = True
    want_outputs: bool = False
    output_device: torch.device = torch.device("cpu")
    input_requires_grad: bool = False
    profile: bool = False
    offload: bool = False  # keep saved activations in pinned host memory instead of on the GPU
    fused_sizes: Optional[list] = None  # the one microbatch joins microbatches of these sizes (fused_call.py): BatchNorm per slice
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
    timings: list = field(default_factory=list)  # (job, device, start mark, stop mark)
    saved_bytes: dict = field(default_factory=dict)  # layer -> bytes of one microbatch's graph
    activation_bytes: dict = field(default_factory=dict)  # layer -> bytes of one microbatch's output
    error: Optional[BaseException] = None
    # Made by the executor for the call.
    graphs: Optional["StageGraphs"] = field(default=None, init=False)  # the fused job's recorded graphs, when replayed
    graph_modes: tuple = field(default=(), init=False)  # train/eval modes of the fused stage's modules
    chain: "Mailbox" = field(init=False)  # results passed from job to job
    prefetched: dict = field(default_factory=dict, init=False)  # job index -> its weights, uploaded early
    buffer_events: list = field(default_factory=list, init=False)  # written-back buffers' download events
    reduce_order: dict = field(default_factory=dict, init=False)  # job index -> its turn among reducing jobs
    lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _opening: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.chain = Mailbox(self)
        n = self.num_microbatch
        self.losses, self.outputs, self.input_grads = [None] * n, [None] * n, [None] * n

    def window(self) -> GradBuffer:
        """The gradient buffer this call writes (opened at the first gradient where the opening was deferred)."""
        if self.grad_buffer is None and self.open_grad_buffer is not None:
            with self._opening:
                if self.grad_buffer is None:
                    self.grad_buffer = self.open_grad_buffer()
        return self.grad_buffer

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None or isinstance(self.error, PassFailed):
                self.error = error
        self.chain.wake()

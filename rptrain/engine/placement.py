"""Where the training state lives: a placement plan per flat run of parameters. Pure data, no torch.

A run is one layer's parameters of one dtype, contiguous in the engine's flat layout (layout.py), so
it moves, steps and is addressed as one piece. A trainable run has a master copy, gradients and
optimizer state; they live together (GPU or host) and its optimizer step runs where they are. A
frozen run has only its weights, stored once.

Policy (``place``): keep as much state on the GPU as fits, the rest on the host. The GPU's budget
for state is its free memory less what the schedule needs there anyway (the compute copy, and a share
kept for activations: fit.py's ``gpu_reserve``). Layers go to the GPU in layer order while their runs fit, and the
first that does not fit ends the GPU share: the engine keeps the GPU share as one prefix of each flat
tensor (gpushare.py). The backward produces the earliest layers' gradients last, so the host keeps
the later layers, whose gradients arrive first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

GPU, HOST = "gpu", "host"
PLACES = (GPU, HOST)
# master: fp32 (or bf16) weights; grads: gradient buffers (the master's dtype if bf16, else fp32);
# optimizer: its state (what the optimizer class declares: rptrain/optim/state.py);
# compute: the weights in the model's dtype that layers compute with (and, on the GPU, the gradients
# staged for download); frozen: requires_grad=False weights; buffers: BatchNorm statistics and such;
# activations: what the schedule keeps on the GPU; pinned_rounding: pinned host blocks are rounded
# up to a power of two by PyTorch's caching host allocator, and those pages are committed too.
KINDS = ("master", "grads", "optimizer", "compute", "frozen", "buffers", "activations", "pinned_rounding")
GiB = 2**30


@dataclass(frozen=True)
class Run:
    """One flat run: layer ``layer``'s parameters of one dtype, ``numel`` elements of ``itemsize`` bytes
    (alignment padding included: it is allocated like the rest). ``master_pad``: elements the master
    layout adds after it (and so the gradient buffers and the optimizer state), to align the next dtype."""

    layer: int
    dtype: str
    numel: int
    itemsize: int
    trainable: bool
    master_pad: int = 0


@dataclass(frozen=True)
class StateBytes:
    """Bytes per trainable parameter of each kind of state, and how many copies each place keeps."""

    master: int = 4  # the optimizer's dtype (fp32)
    optimizer: float = 8  # AdamW: two fp32 moments; 8-bit moments with a scale per block: fractional
    grad: int = 4  # one fp32 gradient buffer (bf16 with a bf16 master)
    host_grad_buffers: int = 2  # the optimizer reads one while the next backward fills the other (async steps)
    # Two as on the host: the window's buffer alternates (versions.py), and a buffer is reused only after
    # the step that read it has finished on the GPU. One would do if the next backward waited on an event
    # recorded after the GPU share's kernels, which the user's step_fn does not expose.
    gpu_grad_buffers: int = 2
    # Versions v and v+1 in the model's dtype, for runs the host steps; 0 when the GPUs keep the model
    # resident and cast every version from the master themselves (resident.py).
    host_compute_copies: int = 2


@dataclass(frozen=True)
class RunPlace:
    """Where run ``run``'s master, gradients and optimizer state live and its step runs (None: frozen)."""

    run: Run
    state: Optional[str]

    @property
    def step(self) -> Optional[str]:
        return self.state


@dataclass(frozen=True)
class Placement:
    runs: tuple[RunPlace, ...]
    totals: dict[str, dict[str, int]]  # place -> kind -> bytes
    gpu_free: int  # measured free GPU memory (0: no GPU)
    host_budget: int
    sources: dict[str, str] = field(default_factory=dict)  # place -> where its budget comes from
    notes: tuple[str, ...] = ()  # assumptions worth printing
    single_version: bool = False  # one version of the weights: one gradient buffer, synchronous steps (host.py)

    def total(self, place: str) -> int:
        return sum(self.totals[place].values())

    def available(self, place: str) -> int:
        return self.gpu_free if place == GPU else self.host_budget

    def short(self) -> dict[str, int]:
        """Bytes missing per place (only places that do not fit)."""
        return {p: self.total(p) - self.available(p) for p in PLACES if self.total(p) > self.available(p)}

    @property
    def fits(self) -> bool:
        return not self.short()

    @property
    def gpu_layers(self) -> int:
        """How many leading layers keep their trainable state on the GPU (0: none)."""
        host = [p.run.layer for p in self.runs if p.state == HOST]
        gpu = [p.run.layer for p in self.runs if p.state == GPU]
        return min(host) if host else max(gpu) + 1 if gpu else 0

    def params_on(self, place: str) -> int:
        return sum(p.run.numel for p in self.runs if p.state == place)

    def __str__(self) -> str:
        lines = [f"placement{'' if self.fits else ' (DOES NOT FIT)'}: GPU {fmt_bytes(self.total(GPU))} of {fmt_bytes(self.gpu_free)} "
                 f"({self.sources.get(GPU, 'free')}), host {fmt_bytes(self.total(HOST))} of {fmt_bytes(self.host_budget)} ({self.sources.get(HOST, 'budget')})"]
        lines += [f"  {n}" for n in self.notes]
        for (first, last), dtype, state in _groups(self.runs):
            what = f"master, grads, optimizer state on the {state.upper()}, step on the {state.upper()}" if state else "frozen weights on the HOST"
            lines.append(f"  layers {first}-{last} {dtype}: {what}")
        lines.append(f"  {'bytes':<16}{'GPU':>12}{'host':>12}")
        for kind in KINDS:
            if self.totals[GPU][kind] or self.totals[HOST][kind]:
                lines.append(f"  {kind:<16}{fmt_bytes(self.totals[GPU][kind]):>12}{fmt_bytes(self.totals[HOST][kind]):>12}")
        return "\n".join(lines)


def fmt_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _groups(runs: Sequence[RunPlace]) -> list[tuple[tuple[int, int], str, Optional[str]]]:
    """Consecutive runs of one dtype and one place, as (first layer, last layer), dtype, place."""
    out: list[list] = []
    for p in runs:
        if out and out[-1][1] == p.run.dtype and out[-1][2] == p.state and out[-1][3] == p.run.trainable:
            out[-1][0][1] = p.run.layer
        else:
            out.append([[p.run.layer, p.run.layer], p.run.dtype, p.state, p.run.trainable])
    return [((a, b), d, s) for (a, b), d, s, _ in out]


def place(runs: Iterable[Run], state: StateBytes, *, gpu_free: int, host_budget: int, gpu_compute: int = 0,
          gpu_activations: int = 0, buffers: int = 0, pinned_rounding: int = 0, gpu_state: bool = True,
          sources: Optional[dict[str, str]] = None, notes: Sequence[str] = (), single_version: bool = False) -> Placement:
    """The placement of ``runs``: trainable runs on the GPU, layer by layer, while their state fits in
    ``gpu_free - gpu_compute - gpu_activations`` (never with ``gpu_state=False``, the engine of today),
    the rest on the host. ``buffers`` and ``pinned_rounding`` are host bytes outside the runs."""
    runs = list(runs)
    totals = {p: dict.fromkeys(KINDS, 0) for p in PLACES}
    totals[GPU].update(compute=gpu_compute, activations=gpu_activations)
    totals[HOST].update(buffers=buffers, pinned_rounding=pinned_rounding)
    room = gpu_free - gpu_compute - gpu_activations if gpu_state else 0
    on_gpu = lambda run: int((run.numel + run.master_pad) * (state.master + state.optimizer + state.grad * state.gpu_grad_buffers))
    need: dict[int, int] = {}
    for run in runs:
        if run.trainable:
            need[run.layer] = need.get(run.layer, 0) + on_gpu(run)
    gpu_layers = 0
    for layer in sorted(need):  # a prefix of the layers: the first that does not fit ends it
        if need[layer] > room:
            break
        room -= need[layer]
        gpu_layers = layer + 1
    placed = []
    for run in runs:
        if not run.trainable:
            totals[HOST]["frozen"] += run.numel * run.itemsize
            placed.append(RunPlace(run, None))
            continue
        where = GPU if run.layer < gpu_layers else HOST
        n = run.numel + run.master_pad
        if where == GPU:
            totals[GPU]["grads"] += n * state.grad * state.gpu_grad_buffers
        else:
            totals[HOST]["grads"] += n * state.grad * state.host_grad_buffers
            totals[HOST]["compute"] += run.numel * run.itemsize * state.host_compute_copies
        totals[where]["master"] += n * state.master
        totals[where]["optimizer"] += int(n * state.optimizer)
        placed.append(RunPlace(run, where))
    return Placement(tuple(placed), totals, gpu_free, host_budget, dict(sources or {}), tuple(notes), single_version)

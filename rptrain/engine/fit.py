"""Will the training state fit? Checked before the engine allocates anything, so a model too big for
the machine gets one error with the numbers instead of a kill by the operating system.

The prediction is the engine's own accounting (``RoundPipe.memory_report``, host.py), made from the
flat layouts alone: master, two gradient buffers (async steps), two compute copies (none when the
GPUs keep the model resident and cast every version themselves: resident.py), frozen weights and
buffers, and the optimizer's state as its class declares it (rptrain/optim/state.py: the optimizer is
made after the engine, from its master parameters; the engine is told which one). On top of that,
small pinned host blocks are rounded up to a power of two by PyTorch's caching host allocator (every
page of the block is locked; pinned.py maps large ones at their exact size), which ``memory_report``
does not show but the machine pays.

With ``gpu_state`` (one GPU, the model resident) the leading layers' master, gradients and optimizer
state go to the GPU as far as they fit (placement.py, gpushare.py); the rest, or everything
otherwise, stays on the host, and the GPU holds the largest layer (or, resident, two versions of
the whole model).
"""
from __future__ import annotations

import gc
import os
import re
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from .device import Device
from .gpushare import cuts
from ..optim.state import OptimizerMemory, state_memory_of
from .host import grad_dtype, master_is_compute_copy, pins_frozen
from .pinned import rounding
from .layout import FlatLayout
from .placement import GPU, HOST, GiB, Placement, Run, StateBytes, fmt_bytes, place
from .tuning import Tuning

# The host budget's default: physical memory (or the cgroup's limit) less max(10%, 4 GiB). The rest of
# the process lives there too: Python, the torch and CUDA libraries and the CUDA context's host side
# (a few GiB), the data pipeline, the model's own weights while the engine copies them, the OS.
# Under torchrun the ranks on one host (LOCAL_WORLD_SIZE) split it: each holds the whole state.
HOST_RESERVE_SHARE = 0.1
HOST_RESERVE_MIN = 4 * GiB
Size = Union[int, float, str, None]


class DoesNotFit(MemoryError):
    """The training state needs more memory than the budgets allow (raised before allocating)."""

    def __init__(self, message: str, placement: Placement):
        super().__init__(message)
        self.placement = placement


def physical_memory() -> int:
    """Bytes of RAM this process may use: the machine's, or its cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Size, name: str = "size") -> Optional[int]:
    """Bytes from an int, a float or a string such as "96GiB", "100 GB" or "1.5e11" (None stays None)."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-z]*)\s*", str(value).lower())
    if not isinstance(value, bool) and match and match.group(2) in _UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _UNITS[match.group(2)])
    raise ValueError(f"{name}={value!r} is not a size: give bytes or a positive number with a unit, e.g. 96GiB or 100GB")


def host_budget(max_host_memory: Size) -> tuple[int, str]:
    """(bytes, where they come from)."""
    if max_host_memory is not None:
        return parse_size(max_host_memory, "max_host_memory"), "max_host_memory"
    physical = physical_memory()
    reserve = max(HOST_RESERVE_MIN, int(HOST_RESERVE_SHARE * physical))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)  # torchrun's ranks on this host share its memory
    shared = f", shared by {ranks} ranks on this host" if ranks > 1 else ""
    return (physical - reserve) // ranks, f"physical {fmt_bytes(physical)} less a {fmt_bytes(reserve)} reserve{shared}; max_host_memory sets another"


# Host bytes each open engine of this process placed there (RoundPipe claims its placement's at construction
# and releases it at close() or when collected): a default budget is what the machine has less what they hold.
_held: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def claim_host(owner: Any, nbytes: int) -> None:
    _held[owner] = nbytes


def release_host(owner: Any) -> None:
    _held.pop(owner, None)


def host_budget_left(max_host_memory: Size) -> tuple[int, str]:
    """``host_budget``, less what the open engines of this process hold where the budget is the machine's
    (an explicit ``max_host_memory`` is this engine's own cap)."""
    budget, source = host_budget(max_host_memory)
    if max_host_memory is not None:
        return budget, source
    if sum(_held.values()) > budget // 100:
        gc.collect()  # engines nobody can reach any more (in cycles not yet collected) let go (0.2 s: only where it matters)
    held = list(_held.values())
    if not any(held):
        return budget, source
    return budget - sum(held), f"{source}; less {fmt_bytes(sum(held))} that {len(held)} open engine(s) of this process hold"


def gpu_budget(devices: Sequence[Device], max_gpu_memory: Size) -> tuple[int, str]:
    """(bytes, where they come from): the least free memory of the engine's GPUs, capped by ``max_gpu_memory``."""
    cuda = [d for d in devices if d.is_cuda]
    if not cuda:
        return 0, "no GPU"
    free = min(d.free_memory() for d in cuda)
    cap = parse_size(max_gpu_memory, "max_gpu_memory")
    if cap is not None and cap < free:
        return cap, "max_gpu_memory"
    return free, "free on the GPU"


def runs_of(layout: FlatLayout) -> list[Run]:
    """One run per layer and dtype: its owned tensors and the padding up to the next run, as the
    flat tensors are allocated (the master's alignment of the next dtype is the last run's ``master_pad``)."""
    keys = list(layout.sizes)
    trainable = any(s.requires_grad for s in layout.slots)
    runs = []
    for i, key in enumerate(keys):
        starts: dict[int, int] = {}
        for slot in layout.slots:
            if slot.key == key:
                starts.setdefault(slot.owner, slot.offset)
        size = layout.sizes[key]
        region = (layout.base[keys[i + 1]] if i + 1 < len(keys) else layout.total) - layout.base[key]
        owners = sorted(starts, key=starts.get)
        for owner, stop in zip(owners, [starts[o] for o in owners[1:]] + [size]):
            if stop > starts[owner]:
                pad = region - size if trainable and stop == size else 0
                runs.append(Run(owner, key, stop - starts[owner], layout.dtypes[key].itemsize, trainable, pad))
    return runs


def host_keeps_compute_copies(resident: bool, refresh_gpu_share: float = Tuning.refresh_gpu_share) -> bool:
    """Whether the host keeps two compute copies (host.py): not when resident GPUs cast every version from
    the master themselves (refresh.py), unless part of that cast runs on the host (``refresh_gpu_share < 1``)."""
    return not resident or refresh_gpu_share < 1.0


def check_fit(layers: Sequence[nn.Module], optim_dtype: torch.dtype, devices: Sequence[Device], resident: bool,
              max_host_memory: Size = None, max_gpu_memory: Size = None, pin_frozen_share: float = Tuning.pin_frozen_share,
              gpu_state: bool = False, gpu_reserve: float = 0.0, notes: Sequence[str] = (), compute_copies: Optional[bool] = None,
              optimizer: Optional[OptimizerMemory] = None, single_version: bool = False) -> Placement:
    """The engine's placement with its budgets; raises DoesNotFit if it does not fit. ``gpu_state``:
    trainable state may go to the GPU (placement.py), keeping ``gpu_reserve`` of its free memory for
    the activations the first call has yet to measure; ``notes``: why it may not, when it may not;
    ``compute_copies``: the host keeps two compute copies of its share (host.py); None: host_keeps_compute_copies(resident);
    ``optimizer``: its state per parameter (None: rptrain.optim.Adam's with this master); ``single_version``:
    the engine keeps one version of the weights (host.py): one gradient buffer, and the host's compute copy
    is its master where their dtypes agree (else one copy)."""
    params, frozen, buffers = FlatLayout.of_parameters(layers, True), FlatLayout.of_parameters(layers, False), FlatLayout.of_buffers(layers)
    pin = any(d.is_cuda and getattr(d, "pins_memory", True) for d in devices)  # as host.py pins (a simulated GPU does not)
    copies = host_keeps_compute_copies(resident) if compute_copies is None else compute_copies
    optimizer = optimizer or state_memory_of(None, optim_dtype)
    grad_bytes = grad_dtype(optim_dtype).itemsize
    aliased = single_version and master_is_compute_copy(params, optim_dtype)
    host_copies = 0 if not copies or aliased else 1 if single_version else 2
    buffers_kept = 1 if single_version else 2
    state = StateBytes(master=optim_dtype.itemsize, optimizer=optimizer.bytes_per_param, grad=grad_bytes, host_compute_copies=host_copies,
                       host_grad_buffers=buffers_kept, gpu_grad_buffers=buffers_kept)
    flat = lambda layout: [n * layout.dtypes[k].itemsize for k, n in layout.sizes.items()]
    frozen_bytes = sum(flat(frozen))
    host, host_from = host_budget_left(max_host_memory)
    gpu, gpu_from = gpu_budget(devices, max_gpu_memory)
    weights = [params.nbytes(i, i + 1) + frozen.nbytes(i, i + 1) for i in range(len(layers))]
    grads = [params.nbytes(i, i + 1) for i in range(len(layers))]  # in the compute dtype, as plan.LayerCost counts them
    # Resident (resident.py): the live copy and the upload slots of the last version and of the one being
    # staged, the frozen weights once; streamed: the largest layer twice, its gradients three times.
    resident_bytes = 3 * sum(grads) + sum(weights) - sum(grads)
    need_gpu = (resident_bytes if resident else max(2 * w + 3 * g for w, g in zip(weights, grads))) if gpu else 0
    runs = runs_of(params) + runs_of(frozen)
    notes = (f"optimizer state: {optimizer.what}",
             *([f"master {optim_dtype} is the stepped copy; gradients travel and accumulate in {grad_dtype(optim_dtype)}".replace("torch.", "")]
               if optim_dtype.itemsize < 4 else []),
             "GPU: the largest layer's weights and gradients (or the resident model); activations are measured by the first call",
             *([f"GPU: {fmt_bytes(int(gpu_reserve * gpu))} ({gpu_reserve:.0%} of free) kept for activations"] if gpu_state else []),
             *([] if copies else ["host: no compute copies (the GPU keeps the model resident and casts every version from the master)"]),
             *([f"one version of the weights (single_version): {'the master is the compute copy' if aliased else f'{host_copies} host compute copy'}, "
                "one gradient buffer; every step is synchronous (the next call waits for it and uses its weights)"] if single_version else []),
             *notes)
    kw = dict(gpu_free=gpu, host_budget=host, gpu_compute=need_gpu, gpu_activations=int(gpu_reserve * gpu) if gpu_state else 0,
              buffers=sum(flat(buffers)), gpu_state=gpu_state, sources={HOST: host_from, GPU: gpu_from}, notes=notes,
              single_version=single_version)
    # host.py's pinned allocations: the host share's compute copies and two gradient buffers, its
    # master when the GPU casts its resident copy from it, the buffers, and the frozen weights up to a
    # share of the machine; pinned.py rounds the small ones up to a power of two.
    plan = place(runs, state, **kw)
    cut = cuts(params, plan.gpu_layers)
    host_params = [(n - cut[k]) * params.dtypes[k].itemsize for k, n in params.sizes.items()] * state.host_compute_copies
    host_master = params.total - sum(cut.values())  # the master layout, alignment included
    pinned = [*host_params, *[host_master * grad_bytes] * buffers_kept, *flat(buffers)] if pin else []
    if pin and pins_frozen(frozen_bytes, pin_frozen_share):
        pinned += flat(frozen)
    if resident or (pin and aliased and copies):
        pinned.append(host_master * optim_dtype.itemsize)
    plan = place(runs, state, pinned_rounding=sum(rounding(n) for n in pinned), **kw)
    if not plan.fits:
        raise DoesNotFit(_message(plan, optim_dtype, optimizer, buffers_kept), plan)
    return plan


def _message(plan: Placement, optim_dtype: torch.dtype, optimizer: OptimizerMemory, grad_buffers: int) -> str:
    parts = []
    for where in plan.short():
        kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.totals[where].items() if v)
        parts.append(f"{where} memory needed {fmt_bytes(plan.total(where))} ({kinds}) but {fmt_bytes(plan.available(where))} "
                     f"available ({plan.sources.get(where, 'budget')})")
    host = plan.totals[HOST]
    options = []
    host_trainable = sum(p.run.numel + p.run.master_pad for p in plan.runs if p.state == HOST)
    low = 2 + grad_buffers * 2 + state_memory_of("rptrain.optim.AdamW", torch.bfloat16, state_dtype="int8").bytes_per_param  # bf16 master and gradients
    now = optim_dtype.itemsize + grad_buffers * grad_dtype(optim_dtype).itemsize + optimizer.bytes_per_param
    if now > low:
        saved = int(host_trainable * (now - low))
        options.append(f"a bf16 master with 8-bit Adam moments (optim_dtype=torch.bfloat16, rptrain.optim.AdamW(state_dtype='int8'); "
                       f"CLI: optim=adamw_lowmem) needs about {fmt_bytes(plan.total(HOST) - saved)} of host memory")
    lora = sum(p.run.numel * p.run.itemsize for p in plan.runs) + host["buffers"]
    options.append(f"LoRA (CLI: model.lora.rank=16) stores the weights once, about {fmt_bytes(lora)} of host memory")
    need = -(-plan.total(HOST) // GiB)
    options.append(f"max_host_memory={need}GiB (CLI: engine.max_host_memory={need}GiB) if the machine has the memory "
                   f"(physical: {fmt_bytes(physical_memory())})")
    options.append("more GPUs do not help yet: every rank keeps its host share of the whole state on its host")
    single = " with one version of the weights (single_version: synchronous steps)" if grad_buffers == 1 else ""
    return f"the training state does not fit{single}: {'; '.join(parts)}. Options: {'; '.join(options)}"

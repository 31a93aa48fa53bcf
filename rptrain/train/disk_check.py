"""Will the checkpoints fit on disk? Checked before the first step, so a run does not train for hours
and then fail (or lose its state) on a full disk.

A checkpoint's size is the sum of its tensors (checkpoint.py writes each in its own dtype, in shards): the
master weights, frozen weights and buffers, and the optimizer's state. The optimizer makes its state
at its first step, so before that the state is predicted per parameter: ``optimizer.state_nbytes(p)``
when the optimizer says (the optimizer-state description), else Adam's moments (two, three with
amsgrad) or SGD's momentum buffer in the parameter's dtype, else two such tensors (assumed, and said).

Rotation (``trainer.keep_checkpoints``) keeps the newest K checkpoints (manifest and shards) and writes the next beside them, so
K + 1 may exist at once; when the disk is short, older ones go first (checkpoint.make_room) but the
newest always stays until the next is written. So the run is refused when the next checkpoint (and the
final Hugging Face export) cannot fit even after every older checkpoint is deleted, and told when fewer
than K + 1 fit.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from rptrain.engine.placement import fmt_bytes

from .checkpoint import LAST, checkpoint_files, checkpoint_nbytes
from .errors import OutputError


def _unique_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple, int] = {}
    for t in tensors:
        seen[(t.device, t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
    return sum(seen.values())


def optimizer_state_nbytes(optimizer: torch.optim.Optimizer) -> tuple[int, bool]:
    """The bytes of ``optimizer``'s state: measured when it has any, else predicted; and whether it was assumed."""
    made = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    if made:
        return _unique_nbytes(made), False
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if hasattr(optimizer, "state_nbytes"):  # the optimizer-state description, where the optimizer has one
        return sum(int(optimizer.state_nbytes(p)) for p in params), False
    defaults = optimizer.defaults
    if "betas" in defaults:  # Adam and its kin: exp_avg, exp_avg_sq (+ max_exp_avg_sq)
        per, assumed = 3 if defaults.get("amsgrad") else 2, not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    elif isinstance(optimizer, torch.optim.SGD):
        per, assumed = (1 if defaults.get("momentum") else 0), False
    else:
        per, assumed = 2, True
    return per * sum(p.numel() * p.element_size() for p in params), assumed


@dataclass
class DiskNeeds:
    checkpoint: int  # bytes of one checkpoint
    export: int  # bytes of the final Hugging Face export (0: none)
    free: int  # free bytes of the file system holding the checkpoints
    older: int  # bytes of this run's checkpoints already there (their shards too), but the newest (rotation may delete them)
    keep: int
    where: Path
    assumed: bool  # the optimizer's state is a guess

    @property
    def room(self) -> int:
        """How many checkpoints can exist at once beside the final export (with the newest already there)."""
        return (self.free + self.older - self.export) // max(1, self.checkpoint)

    def line(self) -> str:
        export = f" plus the Hugging Face export ({fmt_bytes(self.export)})" if self.export else ""
        guess = " (the optimizer's state assumed to be two tensors per parameter)" if self.assumed else ""
        return (f"checkpoints: {fmt_bytes(self.checkpoint)} each{guess}{export}; trainer.keep_checkpoints={self.keep} keeps "
                f"up to {self.keep + 1} at once while the next is written; {self.where} has {fmt_bytes(self.free)} free"
                + (f" and {fmt_bytes(self.older)} in older checkpoints" if self.older else ""))


def disk_needs(checkpoint_dir: Path, model_state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
               keep: int, export_bytes: int = 0) -> DiskNeeds:
    state, assumed = optimizer_state_nbytes(optimizer)
    where = Path(checkpoint_dir).absolute()
    probe = where
    while not probe.exists():  # the run's checkpoints/ folder is made by its first checkpoint
        probe = probe.parent
    files = [f for f in checkpoint_files(where) if f.name != LAST] if where.is_dir() else []
    older = sum(checkpoint_nbytes(f) for f in files[1:])  # manifests and their shards
    nbytes = _unique_nbytes(model_state.values()) + state + 2**20  # the rest of the state: metrics, RNG, config
    return DiskNeeds(nbytes, export_bytes, shutil.disk_usage(probe).free, older, keep, where, assumed)


def check_disk(needs: DiskNeeds) -> Optional[str]:
    """Raise OutputError when not even one checkpoint fits; else the line to show when fewer than
    keep + 1 fit (None when they all do)."""
    if needs.room < 1:
        raise OutputError(f"{needs.line()}: not even one checkpoint fits: free some space, or set output_root to "
                          f"another file system (trainer.hf_export=false saves the export's share)")
    if needs.room < needs.keep + 1:
        if needs.room == 1:
            return f"{needs.line()}: only one fits: the second checkpoint will fail (the first kept)"
        return f"{needs.line()}: only {needs.room} fit: older checkpoints are deleted first when space runs short"
    return None


def export_nbytes(model_state: dict[str, Any], dtype: torch.dtype) -> int:
    """The bytes of the weights exported in ``dtype`` (tied weights once)."""
    floats = [t for t in model_state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.numel() for t in {(t.device, t.data_ptr(), tuple(t.shape)): t for t in floats}.values()) * dtype.itemsize

"""Which path a training call takes: the whole call as one CUDA graph, or stage by stage.

When every stage's state lives on one GPU (the model resident, one fused stage that may be
graphed), a ``forward_backward`` call is its microbatches' forward, loss and backward with nothing
in between that needs the host: wholecall.py records them once as one CUDA graph and replays it,
instead of two stage graphs per microbatch with the loss and the autograd engine run eagerly
between them. Anything else takes today's path, stage by stage (``Lowered`` actions), and
``CallPath.reasons`` says why (``explain()`` prints it).

The decision here is pure data, taken once per call shape before anything runs. What only the
call itself can tell (inputs that require grad, shapes or a ``loss_fn`` never seen, a capture that
fails) is checked by wholecall.py at run time; those calls fall back to the stage path too, and
the reason is kept for ``explain()``. Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .schedule import Job, JobKind

WHOLE = "whole call as one CUDA graph"
STAGED = "stage by stage"


@dataclass(frozen=True)
class CallPath:
    whole: bool  # the call's compute replays one recorded graph (wholecall.py)
    reasons: tuple[str, ...] = ()  # why not, where not

    def __str__(self) -> str:
        if self.whole:
            return f"call path: {WHOLE} (recorded per call shape; a call it cannot hold runs {STAGED})"
        return f"call path: {STAGED}: " + "; ".join(self.reasons)


def decide(jobs: Sequence[Job], *, cuda: bool, whole_call: bool, graphed: bool, reducer: bool, profile: bool,
           offload: bool) -> CallPath:
    """``graphed``: the lowering replays the (only) fused job as CUDA graphs (actions.py decides:
    resident weights, graphs on, not too many parameters); ``whole_call``: the engine's switch
    (``Tuning.whole_call_graphs``)."""
    reasons = []
    if not cuda:
        reasons.append("no GPU")
    elif not whole_call:
        reasons.append("off (Tuning.whole_call_graphs=False)")
    if profile:
        reasons.append("this call measures every layer")
    if len({j.device for j in jobs}) > 1:
        reasons.append(f"{len({j.device for j in jobs})} devices")
    if len(jobs) != 1 or jobs[0].kind is not JobKind.FUSED:
        reasons.append(f"{len(jobs)} stages (the whole call needs a single stage)")
    elif cuda and not graphed:
        reasons.append("the stage is not replayed as CUDA graphs (weights not resident, graphs off, or over Tuning.max_graph_params)")
    if reducer:
        reasons.append("gradients are averaged across processes per stage")
    if offload:
        reasons.append("saved activations go to the host")
    return CallPath(not reasons, tuple(reasons))

"""``ModelExecutePlan``: the original library's plan, written by hand as lists of layer ranges.

``fwd_plan`` lists the forward stages in order; ``bwd_plan`` the backward stages in the order they
run, last layers first. For ``forward_backward`` the first backward stage runs fused (forward,
loss, backward) and ``fwd_plan`` stops where it starts; a ``fwd_plan`` ending with that same stage
is accepted too. For ``model(x)`` and its backward the two lists each cover every layer on their own.
The engine turns it into an ``ExecutePlan`` (plan.py) per call.
"""
from __future__ import annotations

from typing import Any, Optional

from .plan import ExecutePlan


class ModelExecutePlan:
    def __init__(self) -> None:
        self.fwd_plan: list[range] = []
        self.bwd_plan: list[range] = []

    @classmethod
    def auto(cls, run_type: str, *models: Any, min_stages: Optional[int] = None, upper_threshold: float = 1.1,
             model_memory_limit: Optional[float] = None) -> "ExecutePlan | list[ExecutePlan]":
        """The planner's plan for each model (``ExecutePlan.auto``)."""
        return ExecutePlan.auto(run_type, *models, min_stages=min_stages, upper_threshold=upper_threshold,
                                model_memory_limit=model_memory_limit)

    def to_plan(self, fused: bool) -> ExecutePlan:
        """The ``ExecutePlan`` of a ``forward_backward`` (``fused``) or of a ``model(x)`` call."""
        forward, backward = _stages(self.fwd_plan, "fwd_plan"), _stages(self.bwd_plan, "bwd_plan")[::-1]
        if not backward:
            raise ValueError("ModelExecutePlan.bwd_plan needs at least one range of layers")
        if not fused:
            return ExecutePlan(forward or backward, backward, fused=False)
        last = backward[-1]
        if not forward or forward[-1][1] == last[0]:
            forward = forward + (last,)  # the fused stage runs once, after fwd_plan's stages
        elif forward[-1] != last:
            raise ValueError(f"ModelExecutePlan for forward_backward: the first bwd_plan range {range(*last)} runs fused, so fwd_plan "
                             f"must end where it starts (or with it), got {range(*forward[-1])}")
        return ExecutePlan(forward, backward)

    def __repr__(self) -> str:
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan!r}, bwd_plan={self.bwd_plan!r})"


def _stages(ranges: Any, name: str) -> tuple[tuple[int, int], ...]:
    out = []
    for r in ranges:
        if not isinstance(r, range) or r.step != 1 or len(r) == 0:
            raise ValueError(f"ModelExecutePlan.{name} holds ranges of layer indices like range(0, 3), got {r!r}")
        out.append((r.start, r.stop))
    return tuple(out)

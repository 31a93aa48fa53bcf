"""``rptrain.timer``: the original library's per-layer timing switch.

``rptrain.timer.ModelTimer.VERBOSE = True`` prints, whenever the engine measures its layers (the
first training call on a GPU, planning.py), each layer's forward and backward time on stderr in
the original's words (``Layer 3 fwd  new record: 0.412 ms  new estimate: 0.412 ms``). rptrain
measures once and plans from that, so a record is also the estimate. The CPU engine measures
nothing (its plan comes from the layer sizes), so it prints nothing.
"""
from __future__ import annotations

import sys
from typing import Sequence

from .plan import LayerCost


class ModelTimer:
    VERBOSE: bool = False


def report(costs: Sequence[LayerCost]) -> None:
    """Print the measured layer times when ``ModelTimer.VERBOSE`` is set."""
    if not ModelTimer.VERBOSE:
        return
    for i, cost in enumerate(costs):
        for action, seconds in (("fwd", cost.forward_time), ("bwd", cost.backward_time)):
            ms = seconds * 1e3
            print(f"Layer {i} {action}  new record: {ms:.3f} ms  new estimate: {ms:.3f} ms", file=sys.stderr)

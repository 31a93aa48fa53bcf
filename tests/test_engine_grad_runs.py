"""Gradient downloads copy into empty slots and add into written ones, in runs of adjacent slots
(grads.py ``_fresh_runs``); the all-fresh and all-written cases take cached runs (layout.py
``runs_in_range``). Checked against the slots themselves, not against another implementation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from rptrain.engine.grads import _fresh_runs
from rptrain.engine.layout import FlatLayout, Range


def layout() -> FlatLayout:
    # Odd sizes leave alignment padding between some slots: runs must bridge it, and only it.
    layers = [nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3)), nn.Linear(3, 11), nn.LayerNorm(11)]
    return FlatLayout.of_parameters(layers)


@pytest.mark.parametrize("pattern", ["fresh", "written", "mixed"])
def test_runs_cover_every_slot_once_with_its_state_and_are_maximal(pattern):
    lay = layout()
    [key] = lay.sizes
    r = Range(key, 0, lay.sizes[key])
    slots = lay.slots_in_range(r)
    before = [pattern == "written" or (pattern == "mixed" and k % 3 == 0) for k in range(len(lay.slots))]
    buffer = SimpleNamespace(written=list(before))
    for _ in range(2):  # the second call sees the first's marks: every slot written, the cached runs
        runs = _fresh_runs(lay, buffer, r)
        for s in slots:
            [owner] = [run for run in runs if run[0] <= s.offset and s.offset + s.numel <= run[1]]
            assert owner[2] == (not before[s.index])
        for (_, stop, fresh), (start, _, next_fresh) in zip(runs, runs[1:]):
            # a run ends only where the state changes or a gap larger than padding begins
            assert fresh != next_fresh or not any(lay.adjacent(stop, s) for s in slots if s.offset == start)
        assert all(buffer.written[s.index] for s in slots)
        before = list(buffer.written)
    assert len(lay.runs_in_range(r)) < len(slots) or len(slots) == 1  # adjacent slots merged

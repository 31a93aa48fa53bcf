"""Tuning: one value for the engine's measured thresholds, checked when it is made."""
from __future__ import annotations

import pytest
from torch import nn

from rptrain import RoundPipe, Tuning


@pytest.mark.parametrize("bad", [dict(resident_share=1.5), dict(max_graph_params=0), dict(graph_warmup=True),
                                 dict(cpu_optimizer_thread=1), dict(offload_activations="yes"), dict(refresh_gpu_share="0.4")])
def test_bad_tuning_values_are_refused_with_their_name(bad):
    [(name, _)] = bad.items()
    with pytest.raises((TypeError, ValueError), match=f"Tuning.{name}"):
        Tuning(**bad)


def test_roundpipe_takes_only_a_tuning():
    with pytest.raises(TypeError, match="tuning must be"):
        RoundPipe(nn.Sequential(nn.Linear(2, 2)), tuning={"resident_share": 0.1})


@pytest.mark.parametrize("rate", [0, -1.0, "55e9", True])
def test_transfer_rate_is_a_positive_rate_or_none(rate):
    with pytest.raises(ValueError, match="Tuning.transfer_rate must be a positive number of bytes per second"):
        Tuning(transfer_rate=rate)
    assert Tuning(transfer_rate=None).transfer_rate is None and Tuning().transfer_rate == 55.4e9

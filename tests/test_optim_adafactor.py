"""rptrain.optim.Adafactor (one update per parameter: factored moments and whole-tensor norms) against
torch.optim.Adafactor's default implementation.

The update is compiled in use; here it runs uncompiled (the same function), so the test takes no
compile time. Tolerance: rtol 1e-5, atol 1e-6 after several steps (float32). Round trip: exact."""
from __future__ import annotations

import pytest
import torch

from optim_reference import assert_specs_describe_state, compare_with_torch, compiled_matches_torch, engine_matches_torch, round_trip
from rptrain.optim import Adafactor


@pytest.fixture(autouse=True)
def own_update_uncompiled(monkeypatch):
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "0")
    monkeypatch.setattr(Adafactor, "_compiled_eligible", lambda self: True)  # rptrain's update, not torch's step


CASES = {
    "default": dict(),
    "decay": dict(lr=0.05, weight_decay=0.1, beta2_decay=-0.5, d=1.5),
    "eps": dict(lr=0.02, eps=(1e-20, 1e-2), maximize=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
def test_matches_torch(case, split):
    ours, _, _ = compare_with_torch(Adafactor, torch.optim.Adafactor, CASES[case], split=split,
                                    second=dict(lr=0.03, weight_decay=0.0), steps=5, channels_last=split)
    assert_specs_describe_state(ours)


def test_state_dict_round_trip():
    round_trip(Adafactor, dict(lr=0.05, weight_decay=0.1))


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated_gpu"])
def test_through_the_engine(simulated):
    engine_matches_torch(Adafactor, torch.optim.Adafactor, dict(lr=0.05, weight_decay=0.1), simulated=simulated)


def test_torch_step_where_it_cannot_compile(monkeypatch):
    monkeypatch.setattr(Adafactor, "_compiled_eligible", lambda self: False)
    compare_with_torch(Adafactor, torch.optim.Adafactor, dict(lr=0.05), steps=2, rtol=0, atol=0)


@pytest.mark.slow
def test_compiled_update_matches_torch(monkeypatch):
    """The update as it runs in training: compiled once per rank and layout (a minute cold)."""
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "1")
    compiled_matches_torch({case: (Adafactor, torch.optim.Adafactor, CASES[case]) for case in ("decay", "eps")}, per_run=False)

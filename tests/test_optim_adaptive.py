"""rptrain.optim.Adagrad (torch's fused kernel once per flat run), Adadelta, RMSprop and Rprop
(one-pass updates) against torch.optim's default implementations, on engine-like flat parameters.

Tolerance: rtol 1e-5, atol 1e-6 after several steps (float32; the updates round in a different order
than torch's for-loop, a few ulp per step). State-dict round trips: exact."""
from __future__ import annotations

import pytest
import torch

from optim_reference import (
    assert_flat, assert_specs_describe_state, compare_with_torch, engine_matches_torch, compiled_matches_torch, grad_scaler_matches_torch, round_trip,
)
from rptrain.optim import Adadelta, Adagrad, RMSprop, Rprop


@pytest.fixture(autouse=True)
def eager_updates(monkeypatch):
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "0")  # the one-pass updates uncompiled: same code, no compile time


CASES = {
    "adagrad": (Adagrad, torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
    "adagrad_maximize": (Adagrad, torch.optim.Adagrad, dict(lr=0.1, maximize=True)),
    "adadelta": (Adadelta, torch.optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.01)),
    "adadelta_maximize": (Adadelta, torch.optim.Adadelta, dict(maximize=True)),
    "rmsprop": (RMSprop, torch.optim.RMSprop, dict(lr=0.01, weight_decay=0.01)),
    "rmsprop_centered_momentum": (RMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True, alpha=0.9)),
    "rmsprop_centered": (RMSprop, torch.optim.RMSprop, dict(lr=0.01, centered=True, maximize=True)),
    "rmsprop_momentum": (RMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),
    "rprop": (Rprop, torch.optim.Rprop, dict(lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-4, 0.05))),
    "rprop_maximize": (Rprop, torch.optim.Rprop, dict(lr=0.01, maximize=True)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
def test_matches_torch(case, split):
    cls, ref_cls, kwargs = CASES[case]
    ours, _, params = compare_with_torch(cls, ref_cls, kwargs, split=split, second=dict(lr=0.02, weight_decay=0.0),
                                         steps=5, channels_last=split)
    if not split:
        assert_flat(ours, params)
    assert_specs_describe_state(ours)


@pytest.mark.parametrize("case", ["adagrad", "adadelta", "rmsprop_centered_momentum", "rprop"])
def test_state_dict_round_trip(case):
    cls, _, kwargs = CASES[case]
    round_trip(cls, kwargs)


@pytest.mark.parametrize("case", ["adagrad", "rmsprop"])
def test_grad_scaler(case):
    cls, ref_cls, kwargs = CASES[case]
    grad_scaler_matches_torch(cls, ref_cls, kwargs)


@pytest.mark.parametrize("case", ["adagrad", "rmsprop_centered_momentum", "rprop"])
@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated_gpu"])
def test_through_the_engine(case, simulated):
    cls, ref_cls, kwargs = CASES[case]
    engine_matches_torch(cls, ref_cls, kwargs, simulated=simulated)


@pytest.mark.slow
def test_compiled_updates_match_torch(monkeypatch):
    """The one-pass updates as they run in training: compiled (a few seconds each, minutes cold)."""
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "1")
    compiled_matches_torch({case: v for case, v in CASES.items() if v[0]._kernel is not None})  # not the fused ones

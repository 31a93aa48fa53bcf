"""rptrain.optim.Adamax, NAdam and RAdam (one-pass updates over flat runs) against torch.optim's
default implementations, on engine-like flat parameters.

Tolerance: rtol 1e-5, atol 1e-6 after several steps (float32; the updates round in a different order
than torch's for-loop, a few ulp per step). State-dict round trips: exact."""
from __future__ import annotations

import pytest
import torch

from optim_reference import (
    assert_flat, assert_specs_describe_state, compare_with_torch, engine_matches_torch, compiled_matches_torch, round_trip,
)
from rptrain.optim import Adamax, NAdam, RAdam


@pytest.fixture(autouse=True)
def eager_updates(monkeypatch):
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "0")  # the one-pass updates uncompiled: same code, no compile time


CASES = {
    "adamax": (Adamax, torch.optim.Adamax, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.01)),
    "adamax_maximize": (Adamax, torch.optim.Adamax, dict(lr=0.01, maximize=True)),
    "nadam": (NAdam, torch.optim.NAdam, dict(lr=0.01, weight_decay=0.01, momentum_decay=0.01)),
    "nadam_decoupled": (NAdam, torch.optim.NAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
    "radam": (RAdam, torch.optim.RAdam, dict(lr=0.01, weight_decay=0.01)),
    # beta2 0.9: rho_inf = 19, so the rectified branch starts at the seventh step
    "radam_rectified": (RAdam, torch.optim.RAdam, dict(lr=0.01, betas=(0.9, 0.9), weight_decay=0.1, decoupled_weight_decay=True)),
    "radam_maximize": (RAdam, torch.optim.RAdam, dict(lr=0.01, betas=(0.9, 0.9), maximize=True)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
def test_matches_torch(case, split):
    cls, ref_cls, kwargs = CASES[case]
    ours, _, params = compare_with_torch(cls, ref_cls, kwargs, split=split, second=dict(lr=0.02, weight_decay=0.0),
                                         steps=8, channels_last=split)
    if not split:
        assert_flat(ours, params)
    assert_specs_describe_state(ours)


@pytest.mark.parametrize("case", ["adamax", "nadam", "radam_rectified"])
def test_state_dict_round_trip(case):
    cls, _, kwargs = CASES[case]
    round_trip(cls, kwargs, steps=4)


@pytest.mark.parametrize("case", ["adamax", "nadam", "radam"])
@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated_gpu"])
def test_through_the_engine(case, simulated):
    cls, ref_cls, kwargs = CASES[case]
    engine_matches_torch(cls, ref_cls, kwargs, simulated=simulated)


@pytest.mark.slow
def test_compiled_updates_match_torch(monkeypatch):
    """The one-pass updates as they run in training: compiled (a few seconds each, minutes cold)."""
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "1")
    compiled_matches_torch({case: v for case, v in CASES.items() if v[0]._kernel is not None})  # not the fused ones


@pytest.mark.parametrize("case", ["adamax", "nadam", "radam"])
def test_moments_use_complements_rounded_once(case):
    """``1 - beta2`` is taken in double and rounded once, as torch does: in float32, 1 - 0.999 is off by
    1.3e-5 relative, and every second moment with it. After one step the moments match torch's to 1e-6."""
    cls, ref_cls, kwargs = CASES[case]
    ours, theirs, params = compare_with_torch(cls, ref_cls, {**kwargs, "betas": (0.999, 0.999)}, steps=1)
    for p, r in zip(params, theirs.state):
        for name in ("exp_avg", "exp_avg_sq", "exp_inf"):
            if name in theirs.state[r]:
                torch.testing.assert_close(ours.state[p][name], theirs.state[r][name], rtol=1e-6, atol=0)

"""rptrain.optim.SGD (torch's fused kernel once per flat run) and ASGD (a one-pass update) against
torch.optim's default implementations, on engine-like flat parameters.

Tolerance: rtol 1e-5, atol 1e-6 after several steps (float32; the fused and one-pass updates round
in a different order than torch's for-loop, a few ulp per step). State-dict round trips: exact."""
from __future__ import annotations

import pytest
import torch

from optim_reference import (
    assert_flat, assert_specs_describe_state, compare_with_torch, compiled_matches_torch, engine_matches_torch, flat_params,
    grad_scaler_matches_torch, round_trip,
)
from rptrain.optim import ASGD, SGD


@pytest.fixture(autouse=True)
def eager_updates(monkeypatch):
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "0")  # the one-pass updates uncompiled: same code, no compile time


SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "maximize": dict(lr=0.1, momentum=0.5, maximize=True),
}


@pytest.mark.parametrize("case", SGD_CASES)
@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
def test_sgd_matches_torch(case, split):
    ours, _, params = compare_with_torch(SGD, torch.optim.SGD, SGD_CASES[case], split=split, second=dict(lr=0.05, weight_decay=0.0),
                                         channels_last=split)
    if case != "plain" and not split:
        assert_flat(ours, params)
    assert_specs_describe_state(ours)


ASGD_CASES = {
    "averaging": dict(lr=0.05, lambd=1e-2, t0=2, weight_decay=0.01),
    "before_averaging": dict(lr=0.05, alpha=0.5),
    "maximize": dict(lr=0.05, t0=1, maximize=True),
}


@pytest.mark.parametrize("case", ASGD_CASES)
@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
def test_asgd_matches_torch(case, split):
    ours, _, params = compare_with_torch(ASGD, torch.optim.ASGD, ASGD_CASES[case], split=split, second=dict(lr=0.02, t0=0),
                                         steps=5, channels_last=split)
    if not split:
        assert_flat(ours, params)
    assert_specs_describe_state(ours)


@pytest.mark.parametrize("cls, kwargs", [(SGD, dict(lr=0.1, momentum=0.9, nesterov=True)), (ASGD, dict(lr=0.05, t0=1))])
def test_state_dict_round_trip(cls, kwargs):
    round_trip(cls, kwargs)


def test_sgd_grad_scale_divides_and_found_inf_skips():
    """GradScaler hands fused optimizers the scale (no pass to unscale): the kernel divides by it."""
    params, grads = flat_params()
    ref_params, ref_grads = flat_params()
    opt, ref = SGD(params, lr=0.1, momentum=0.9), SGD(ref_params, lr=0.1, momentum=0.9)
    assert opt._step_supports_amp_scaling
    for p, r in zip(params, ref_params):
        p.grad.fill_(8.0)
        r.grad.fill_(1.0)
    opt.grad_scale = torch.tensor(8.0)
    opt.step()
    del opt.grad_scale
    ref.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)
    before = [p.detach().clone() for p in params]
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))


@pytest.mark.parametrize("cls, ref_cls", [(SGD, torch.optim.SGD), (ASGD, torch.optim.ASGD)])
def test_grad_scaler(cls, ref_cls):
    grad_scaler_matches_torch(cls, ref_cls, dict(lr=0.01))


def test_scheduler_changes_the_flat_step():
    params, grads = flat_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = SGD(params, lr=0.1, momentum=0.9), torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ours, theirs)]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, r in zip(params, ref):
            p.grad.copy_(torch.randn(p.shape, generator=g))
            r.grad = p.grad.clone()
        ours.step()
        theirs.step()
        for s in schedules:
            s.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, ref_cls, kwargs", [(SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                                   (ASGD, torch.optim.ASGD, dict(lr=0.05, t0=1))])
@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated_gpu"])
def test_through_the_engine(cls, ref_cls, kwargs, simulated):
    engine_matches_torch(cls, ref_cls, kwargs, simulated=simulated)


@pytest.mark.slow
def test_compiled_updates_match_torch(monkeypatch):
    """The one-pass updates as they run in training: compiled (a few seconds each, minutes cold)."""
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "1")
    compiled_matches_torch({case: (ASGD, torch.optim.ASGD, options) for case, options in ASGD_CASES.items()})

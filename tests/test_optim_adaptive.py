"""rptrain.optim.Adagrad (torch's fused kernel once per flat run), Adadelta, RMSprop and Rprop
(one-pass updates) against torch.optim's default implementations, on engine-like flat parameters.

Tolerance: rtol 1e-5, atol 1e-6 after several steps (float32; the updates round in a different order
than torch's for-loop, a few ulp per step). State-dict round trips: exact."""
from __future__ import annotations

import pytest
import torch

from optim_reference import (
    assert_flat, assert_specs_describe_state, compare_with_torch, compiled_matches_torch, engine_matches_torch, flat_params,
    grad_scaler_matches_torch, round_trip,
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


@pytest.mark.parametrize("case", ["rmsprop_momentum", "adagrad"])
def test_parameters_that_missed_steps_take_torchs_step(case):
    """A parameter without a gradient for a while has a smaller step count than its neighbours: one run
    cannot share one count, so torch steps them (each with its own count; a shared one advanced once
    per parameter) and the numbers stay torch's (Adagrad's learning-rate decay reads the count)."""
    cls, ref_cls, kwargs = CASES[case]
    kwargs = {**kwargs, "lr_decay": 0.1} if case == "adagrad" else kwargs
    params, grads = flat_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = cls(params, **kwargs), ref_cls(ref, **kwargs)
    flat_grads = [p.grad for p in params]
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        for i, (p, r, view) in enumerate(zip(params, ref, flat_grads)):
            view.copy_(torch.randn(p.shape, generator=g))
            p.grad = view if step != 1 or i == 0 else None  # the second step only the first parameter learns
            r.grad = None if p.grad is None else view.clone()
        ours.step()
        theirs.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert ours.state[params[0]]["step"] == 4 and ours.state[params[1]]["step"] == 3


def test_a_failed_compile_warns_and_steps_eagerly(monkeypatch):
    """No C++ compiler (or any compile error): one warning, then the same update uncompiled."""
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "1")
    kernel = Adadelta._kernel

    def broken():
        raise RuntimeError("no compiler here\nmore detail")

    monkeypatch.setattr(kernel, "_compiled_fn", broken)
    monkeypatch.setattr(kernel, "_failed", False)
    with pytest.warns(RuntimeWarning, match="compiling _adadelta_update failed .RuntimeError: no compiler here.; stepping eagerly"):
        compare_with_torch(Adadelta, torch.optim.Adadelta, dict(lr=0.5), steps=3)
    assert kernel._failed


@pytest.mark.parametrize("case", ["adadelta", "rmsprop_centered_momentum"])
def test_averages_use_complements_rounded_once(case):
    """``1 - alpha`` (``1 - rho``) is taken in double and rounded once, as torch does: in float32,
    1 - 0.999 is off by 1.3e-5 relative. After one step the averages match torch's to 1e-6."""
    cls, ref_cls, kwargs = CASES[case]
    decay = {"rho": 0.999} if cls is Adadelta else {"alpha": 0.999}
    ours, theirs, params = compare_with_torch(cls, ref_cls, {**kwargs, **decay}, steps=1)
    for p, r in zip(params, theirs.state):
        for name in ("square_avg", "grad_avg", "acc_delta"):
            if name in theirs.state[r]:
                torch.testing.assert_close(ours.state[p][name], theirs.state[r][name], rtol=1e-6, atol=0)

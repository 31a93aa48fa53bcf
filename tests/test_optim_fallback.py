"""After flat steps, a step that falls back to torch's own implementation (gradients laid out unlike
their parameters, here transposed) counts each parameter's step once, though the flat path shared one
count per run (it advanced once per parameter, so Adam's bias correction went wrong by 4e-3)."""
from __future__ import annotations

import pytest
import torch

from rptrain.optim import Adam, NAdam, RMSprop
from test_optim import flat_params


@pytest.fixture(autouse=True)
def eager_updates(monkeypatch):
    monkeypatch.setenv("RPTRAIN_OPTIM_COMPILE", "0")


@pytest.mark.parametrize("cls, ref_cls", [(Adam, torch.optim.Adam), (NAdam, torch.optim.NAdam), (RMSprop, torch.optim.RMSprop)])
def test_torch_step_after_flat_steps_counts_once(cls, ref_cls):
    params, _ = flat_params([(4, 4), (4, 4), (3,)])
    flat_grads = [p.grad for p in params]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = cls(params, lr=1e-2), ref_cls(ref, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for arrangement in ("flat", "transposed", "transposed"):
        new = [torch.randn(p.shape, generator=g) for p in params]
        for p, r, value, view in zip(params, ref, new, flat_grads):
            if arrangement == "flat":
                p.grad = view.copy_(value)
            else:
                p.grad = value.t().contiguous().t() if value.dim() == 2 else value.clone()
            r.grad = value.clone()
        ours.step()
        theirs.step()
    assert [float(ours.state[p]["step"]) for p in params] == [3.0] * 3
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)

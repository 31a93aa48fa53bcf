"""state_dict / load_state_dict and the views the user sees."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.optim import Adam


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def trained_engine(steps: int = 3, dtype=torch.float32):
    engine = RoundPipe(net().to(dtype))
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g).to(dtype)
        y = torch.randint(0, 3, (8,), generator=g)
        engine.forward_backward((x,), label=y, loss_fn=lambda o, t: nn.functional.cross_entropy(o.float(), t),
                                run_config=RoundPipeRunConfig(num_microbatch=1))
        engine.step(lambda: (opt.step(), opt.zero_grad()))
    return engine, opt


def test_state_dict_has_the_sequential_names_and_master_dtype():
    engine, _ = trained_engine(dtype=torch.float16)
    state = engine.state_dict()
    assert list(state) == list(net().state_dict())
    assert state["0.weight"].dtype == torch.float32  # master weights
    assert state["1.running_mean"].dtype == torch.float16  # buffers keep the model's dtype
    assert state["1.num_batches_tracked"].item() == 3
    plain = net().half()
    plain.load_state_dict(state)  # loads straight into the plain model


def test_load_state_dict_after_the_optimizer_exists_takes_effect():
    engine, opt = trained_engine()
    engine.synchronize()  # the compute copy trails the master by one step until now
    saved = copy.deepcopy(engine.state_dict())
    x = torch.randn(5, 4)
    engine.eval()
    with torch.no_grad():
        before = engine(x)
    trained_engine_other, _ = trained_engine(steps=6)
    engine.load_state_dict(trained_engine_other.state_dict())
    with torch.no_grad():
        assert not torch.allclose(engine(x), before)
    engine.load_state_dict(saved)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), before)
    # The optimizer owns the very tensors that were loaded into.
    with OptimizerCtx():
        names = dict(engine.named_parameters())
    assert names["0.weight"] is opt.param_groups[0]["params"][0]
    torch.testing.assert_close(opt.param_groups[0]["params"][0].cpu(), saved["0.weight"])  # the master may live on the GPU


def test_load_state_dict_errors():
    engine, _ = trained_engine(steps=1)
    state = engine.state_dict()
    with pytest.raises(KeyError, match="missing keys.*0.bias"):
        engine.load_state_dict({k: v for k, v in state.items() if k != "0.bias"})
    bad = dict(state)
    bad["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'0.weight' has shape \(3, 3\), the model expects \(8, 4\)"):
        engine.load_state_dict(bad)
    result = engine.load_state_dict({**state, "extra": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["extra"]


def test_parameters_outside_and_inside_optimizer_ctx():
    engine = RoundPipe(net().half())
    outside = list(engine.parameters())
    with OptimizerCtx():
        inside = list(engine.parameters())
    assert [p.dtype for p in outside] == [torch.float16] * 6
    assert [p.dtype for p in inside] == [torch.float32] * 6
    assert [p.shape for p in outside] == [p.shape for p in inside]

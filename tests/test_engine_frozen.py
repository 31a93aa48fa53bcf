"""Frozen parameters (requires_grad=False) are stored once, in their own dtype, with no master,
gradient or optimizer state, and training around them matches plain PyTorch (fp32, rel 1e-5)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from reference import assert_state_close
from rptrain import ExecutePlan
from test_engine_equivalence import train_both, vector_batches


class Cast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def partly_frozen() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                          Cast(torch.bfloat16), nn.Linear(32, 4, dtype=torch.bfloat16), Cast(torch.float32))
    model[0].requires_grad_(False)  # a whole layer
    model[4].weight.requires_grad_(False)  # half of one: its bias still trains
    model[7].requires_grad_(False)  # another dtype
    return model


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("plan", [ExecutePlan.single_stage(9), ExecutePlan.from_cuts(9, [2, 6], [1, 4, 6])], ids=["single", "multi"])
def test_training_around_frozen_parameters_matches_pytorch(plan, delayed):
    engine, ref = train_both(partly_frozen(), vector_batches(count=4), 2, plan=plan, delayed=delayed)
    assert_state_close(engine.state_dict(), ref.state())
    assert engine.state_dict()["7.weight"].dtype == torch.bfloat16
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    host = engine._host
    # One copy each: the model's frozen parameters are views of the engine's frozen flats.
    flats = {t.untyped_storage().data_ptr() for t in host.frozen.values()}
    assert {p.untyped_storage().data_ptr() for p in frozen} <= flats
    assert len(host.master_params) == len(trainable)
    report = engine.memory_report()
    assert report["frozen"] == sum(t.untyped_storage().nbytes() for t in host.frozen.values())
    for name, nbytes in [("master", 4), ("grads", 4 * len(host.grads))]:  # trainable only, plus 256-byte padding
        assert report[name] <= nbytes * sum(p.numel() for p in trainable) + 256 * nbytes * len(trainable)


def test_frozen_weights_load_and_stay():
    model = partly_frozen()
    engine, _ = train_both(model, vector_batches(count=2), 1)
    state = engine.state_dict()
    torch.testing.assert_close(state["0.weight"], model[0].weight.detach())
    state["0.weight"] = torch.ones_like(state["0.weight"])
    engine.load_state_dict(state)
    host = engine._host
    torch.testing.assert_close(host.frozen_layout.view(host.frozen, host.frozen_layout.slots[0]), torch.ones(32, 8))
    model.load_state_dict(state)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_frozen_host_memory_is_their_own_size():
    """~335 M frozen bf16 parameters (671 MB): the process's anonymous memory grows by at most their
    size + 5% from before the model is built to after a training step, and peaks at most one layer
    higher while the engine copies them in (each original is let go as soon as it is copied)."""
    worker = Path(__file__).with_name("frozen_memory_worker.py")
    out = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=120, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    frozen = m["frozen_bytes"]
    assert frozen > 600e6
    assert m["delta"] <= 1.05 * frozen, m
    assert m["peak_delta"] <= 1.05 * frozen + m["largest_bytes"], m
    report = m["report"]
    assert frozen <= report["frozen"] <= 1.001 * frozen
    assert report["master"] + report["grads"] + report["compute"] + report["optimizer"] < 2e6  # the trainable head only

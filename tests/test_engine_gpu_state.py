"""GPU-resident optimizer shares (engine/gpushare.py): the leading layers' master, gradients and
optimizer state on the GPU, the rest on the host, each placement against plain PyTorch
(tests/reference.py) at the equivalence suite's tolerances (fp32: rtol 1e-5; fp16 compute with an
fp32 master: 2e-3). On a CUDA machine they run on the real GPU, elsewhere on a SimulatedDevice,
which takes the same code paths on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from reference import assert_state_close
from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine.gpushare import cuts
from rptrain.engine.layout import FlatLayout
from rptrain.engine.placement import HOST
from rptrain.engine.simulated import SimulatedDevice
from rptrain.optim import Adam
from test_engine_equivalence import mlp, train_both, vector_batches
from test_engine_scaler import model16, train_scaled_against_reference

CUDA = torch.cuda.is_available()
NO_RESERVE = Tuning(gpu_state_reserve=0.0, streamed_gpu_state_reserve=0.0)  # budgets below are exact: nothing kept back for activations
PLAN = ExecutePlan.from_cuts(7, forward=[2, 5], backward=[1, 3, 5])


def device():
    return "cuda:0" if CUDA else SimulatedDevice(0)


def split_budget(model: nn.Sequential, layers: int) -> int:
    """GPU bytes for three resident copies of the weights (fit.py) plus the first ``layers`` layers' state
    (fp32 master 4 + Adam 8 + two gradient buffers 8 = 20 bytes a parameter, padding included)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * weights + 20 * sum(cuts(FlatLayout.of_parameters(list(model)), layers).values()) + 16


def placement_kw(where: str, model: nn.Sequential) -> dict:
    if where == "host":
        return dict(gpu_state=False)
    if where == "split":
        return dict(max_gpu_memory=split_budget(model, 3), tuning=NO_RESERVE)
    return dict(tuning=NO_RESERVE)


def check_placement(engine: RoundPipe, where: str) -> None:
    host, layers = engine._host, len(engine._layers)
    expected = {"host": 0, "split": 4, "gpu": layers}[where]  # split: layers 0-3 (3 has no parameters), the host from 4
    assert engine.placement.gpu_layers == expected
    assert (host.gpu is None) == (where == "host")
    with OptimizerCtx():
        masters = list(engine.parameters())
    on_gpu = [host.gpu is not None and host.gpu.holds(s) for s in host.params.slots]
    assert sum(on_gpu) == {"host": 0, "split": 4, "gpu": len(masters)}[where]  # weight and bias of layers 0 and 2
    if CUDA:
        assert [m.device.type == "cuda" for m in masters] == on_gpu
    # The host allocates no master or gradients for the GPU share (one fp32 flat tensor here: the host
    # keeps elements [cut, total) of it), and no compute copies at all: the model is resident, the GPU
    # casts every version from the master.
    cut = host.gpu.cut["float32"] if host.gpu else 0
    n = host.params.sizes["float32"] - cut
    assert (n == 0) == (where == "gpu") and (cut == 0) == (where == "host")
    report = engine.memory_report()
    assert engine._executor.resident and host.compute is None and report["compute"] == 0
    assert report["master"] == 4 * (-(-n // 64) * 64)  # aligned to 256 bytes, as layout.py aligns
    assert report["grads"] == len(host.grads) * report["master"]
    predicted = engine.placement.totals[HOST]  # fit.py's prediction of the same, before allocating
    assert predicted["master"] == report["master"] and predicted["compute"] == report["compute"]
    assert predicted["grads"] == 2 * report["master"]  # both buffers (async steps) counted


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["gpu", "split", "host"])
def test_each_placement_matches_pytorch(where, delayed):
    kw = placement_kw(where, mlp())
    engine, ref = train_both(mlp(), vector_batches(count=4), 2, plan=PLAN, delayed=delayed, devices=[device()], **kw)
    check_placement(engine, where)
    state = engine.state_dict()
    assert all(t.device.type == "cpu" for t in state.values())  # checkpoints hold host tensors wherever the state lives
    assert_state_close(state, ref.state())
    for name, p in engine.model.named_parameters():  # after synchronize() the model shows the master (fp32: exactly)
        assert torch.equal(p.detach().cpu(), state[name]), name
    if where != "host":
        last = {"split": 2, "gpu": 6}[where]  # the last layer with parameters on the GPU
        assert f"layers 0-{last} float32: master, grads, optimizer state on the GPU" in str(engine.placement)
        assert str(engine.placement) in engine.explain(vector_batches(count=1)[0][0])
    engine.close()


def _train(engine, opt, data, cfg):
    for x, y in data:
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    engine.synchronize()


def test_split_state_dicts_round_trip_exactly():
    """Engine and optimizer state saved mid-run and loaded into a fresh split engine continue exactly
    like the original (bitwise: same kernels, same state)."""
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN)
    data = vector_batches(count=5)
    kw = placement_kw("split", mlp())

    def fresh():
        engine = RoundPipe(copy.deepcopy(mlp()), devices=[device()], **kw)
        with OptimizerCtx():
            opt = Adam(engine.parameters(), lr=1e-2)
        return engine, opt

    a, opt_a = fresh()
    _train(a, opt_a, data[:3], cfg)
    saved, saved_opt = a.state_dict(), copy.deepcopy(opt_a.state_dict())
    b, opt_b = fresh()
    check_placement(b, "split")
    b.load_state_dict(saved)
    opt_b.load_state_dict(saved_opt)
    for engine, opt in ((a, opt_a), (b, opt_b)):
        _train(engine, opt, data[3:], cfg)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    for p, q in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        assert p.device == q.device and torch.equal(opt_a.state[p]["exp_avg_sq"], opt_b.state[q]["exp_avg_sq"])
    a.close()
    b.close()


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("is_async", [False, True])
def test_grad_scaler_skips_the_inf_step_on_both_shares(is_async, clip):
    """fp16 compute: the third iteration overflows; its step is skipped on the GPU and the host share
    (and clipping unscales and measures both)."""
    engine = RoundPipe(model16(), devices=[device()], max_gpu_memory=split_budget(model16(), 1), tuning=NO_RESERVE)
    assert engine.placement.gpu_layers == 2 and engine._host.gpu is not None  # layer 0 (1 has no parameters)
    train_scaled_against_reference(engine, is_async, clip)
    engine.close()


def test_state_stays_on_the_host_where_the_gpu_cannot_own_it():
    """Two GPUs in one process each compute every stage, so the placement keeps the state on the host
    and says why; gpu_state=False says so too."""
    two = RoundPipe(mlp(), devices=[SimulatedDevice(0), SimulatedDevice(1)])
    assert two._host.gpu is None and "2 GPUs in one process" in str(two.placement)
    off = RoundPipe(mlp(), devices=[SimulatedDevice(0)], gpu_state=False)
    assert off._host.gpu is None and "gpu_state=False" in str(off.placement)
    with pytest.raises(TypeError, match="gpu_state must be True or False"):
        RoundPipe(mlp(), devices=[SimulatedDevice(0)], gpu_state="auto")
    two.close()
    off.close()

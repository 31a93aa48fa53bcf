"""Staging new weights on resident GPUs from the master (engine/refresh.py).

The staged copy must equal the master cast to the model's dtype bit for bit, whichever side did
the cast: CPU and GPU both round to nearest even.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from reference import Reference, assert_state_close, ran_as_one_batch
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine import refresh
from rptrain.engine.device import CpuDevice
from rptrain.engine.gpushare import cuts
from rptrain.engine.simulated import SimulatedDevice
from rptrain.engine.host import HostState
from rptrain.engine.layout import FlatLayout
from rptrain.optim import Adam


class ToFloat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def mixed_model() -> nn.Sequential:
    """fp16 layers (cast on the way) and an fp32 layer (copied straight from the master)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 300).half(), nn.Linear(300, 30).half(), ToFloat(), nn.Linear(30, 5))


def test_split_covers_every_element_once():
    layout = FlatLayout.of_parameters(list(mixed_model()))
    on_gpu, on_host = refresh.split(layout, torch.float32, gpu_share=0.4, chunk=2048)
    for key, size in layout.sizes.items():
        ranges = sorted((r.start, r.stop) for r in on_gpu + on_host if r.key == key)
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
        assert all(stop - start <= 2048 for start, stop in ranges)
    half = sum(r.numel for r in on_gpu if r.key == "float16")
    assert half % 1024 == 0 and 0.3 * layout.sizes["float16"] < half <= 0.4 * layout.sizes["float16"]
    assert not [r for r in on_host if r.key == "float32"]  # as wide as the master: always uploaded whole
    gpu_only, host_none = refresh.split(layout, torch.float32, gpu_share=1.0)
    assert not host_none and sum(r.numel for r in gpu_only) == sum(layout.sizes.values())
    with pytest.raises(ValueError, match="gpu_share"):
        refresh.split(layout, torch.float32, gpu_share=1.5)


def test_staged_copy_is_the_master_cast_and_host_gets_its_share():
    layers = list(mixed_model())
    host = HostState(layers, torch.float32, pin_memory=False)
    with torch.no_grad():
        host.master.normal_()  # a new version, different from what the compute copies hold
    before = {k: t.clone() for k, t in host.compute[1].items()}
    plan = refresh.split(host.params, torch.float32, gpu_share=0.5, chunk=4096)
    [(pieces, event)] = refresh.stage_version(host, [CpuDevice(0)], 1, plan).values()
    event.synchronize()
    for r, t in pieces:
        expected = host.params.master_range(host.master, r).to(t.dtype)
        assert torch.equal(t, expected)
    on_gpu, on_host = plan
    for r in on_host:
        assert torch.equal(host.compute_range(1, r), host.params.master_range(host.master, r).to(host.params.dtypes[r.key]))
    for r in on_gpu:  # the GPU's share is not written on the host (synchronize() does that)
        assert torch.equal(host.compute_range(1, r), before[r.key][r.start : r.stop])


@pytest.mark.parametrize("gpu_state", [False, True], ids=["host_master", "gpu_master"])
@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_resident_gpu_weights_are_the_master_cast_after_every_step(share, gpu_state):
    """fp16 model, async steps: the GPU's copy of each version equals the fp32 master cast (from the
    host, or for the GPU share from its master there), and training matches plain PyTorch one step
    stale. On the GPU when there is one, else on a SimulatedDevice."""
    model = mixed_model()
    device = "cuda:0" if torch.cuda.is_available() else SimulatedDevice(0)
    engine = RoundPipe(copy.deepcopy(model), tuning=Tuning(refresh_gpu_share=share), devices=[device], gpu_state=gpu_state)
    assert engine._executor.resident and (engine._host.gpu is not None) == gpu_state
    # below share 1 the host casts part of its share of each version (the GPU share here: everything) into
    # two host compute copies; at 1 it keeps none
    assert (engine._host.compute is None) == (share == 1.0)
    assert bool(engine._executor.store._refresh_plan[1]) == (share < 1.0 and not gpu_state)
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    ref = Reference(model, lr=1e-2, delayed=True, device=engine.devices[0].type)
    loss_fn = lambda out, y: nn.functional.cross_entropy(out.float(), y)
    host = engine._host
    torch.manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 40).half(), torch.randint(0, 5, (8,))
        loss = engine.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=RoundPipeRunConfig(num_microbatch=2))
        engine.step(lambda: (opt.step(), opt.zero_grad()))
        assert loss.item() == pytest.approx(ref.forward_backward(x, y, 2, loss_fn, fused=ran_as_one_batch(engine)), rel=2e-3)
        ref.step()
        engine.wait_for_steps()
        newest = max(engine._executor.store.resident[0].staged)
        for r, t in engine._executor.store.resident[0].staged[newest].pieces:
            parts = host.gpu.split(r) if host.gpu is not None else (r,)
            master = torch.cat([host.master_range(part).cpu() for part in parts if part is not None])
            assert torch.equal(t.cpu(), master.to(t.dtype))
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(engine.model[0].weight.cpu(), engine.state_dict()["0.weight"].half(), rtol=0, atol=0)
    engine.close()


def test_a_version_that_fails_to_stage_is_staged_from_the_master_when_a_call_needs_it(monkeypatch):
    """If staging fails (say the GPU is out of memory), the error reaches the caller; the master still
    holds that version (the host keeps no compute copy), so the next call stages it from there and
    training goes on like plain PyTorch. Split placement: part of the master on the GPU, part on the host."""
    model = mixed_model()
    layout = FlatLayout.of_parameters(list(model))  # three resident copies (fit.py) and layer 0's state, 20 bytes a parameter
    budget = 3 * layout.nbytes(0, len(model)) + 20 * sum(cuts(layout, 1).values())
    engine = RoundPipe(copy.deepcopy(model), devices=[SimulatedDevice(0)], max_gpu_memory=budget, tuning=Tuning(gpu_state_reserve=0.0))
    host = engine._host
    assert engine._executor.resident and host.compute is None and host.gpu is not None and host.host.ranges()
    stage, failures = refresh.stage_version, []

    def fail_once(*args, **kw):
        if not failures:
            failures.append(args)
            raise torch.OutOfMemoryError("no memory for the staged copy")
        return stage(*args, **kw)

    monkeypatch.setattr(refresh, "stage_version", fail_once)
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    ref = Reference(model, lr=1e-2, device=engine.devices[0].type)
    loss_fn = lambda out, t: nn.functional.cross_entropy(out.float(), t)
    torch.manual_seed(1)
    for i in range(3):
        x, y = torch.randn(8, 40).half(), torch.randint(0, 5, (8,))
        loss = engine.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=RoundPipeRunConfig(num_microbatch=2))
        assert loss.item() == pytest.approx(ref.forward_backward(x, y, 2, loss_fn, fused=ran_as_one_batch(engine)), rel=2e-3)
        if i == 0:
            with pytest.raises(RuntimeError, match="optimizer step failed"):
                engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            assert 1 not in engine._executor.store.resident[0].staged
        else:
            engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref.step()
    assert len(failures) == 1
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state(), rtol=2e-3, atol=2e-3)
    engine.close()

"""Host compute copies only where a GPU does not hold the weights (engine/host.py, resident.py).

Resident GPUs cast every version from the master themselves, so the host allocates no compute copy;
the wrapped model's parameters then stay host tensors of their own, written at synchronize(). Streamed GPUs and CPU engines
keep their two host copies. Training is checked against plain PyTorch (tests/reference.py) at the
equivalence suite's tolerance (fp32: rtol 1e-5), sync and one step stale, with the state on the
GPU, on the host and split; on a SimulatedDevice (the CUDA code paths, on the CPU) or a real GPU.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from reference import assert_state_close
from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine.placement import HOST
from rptrain.engine.simulated import SimulatedDevice
from rptrain.optim import Adam
from test_engine_equivalence import mlp, train_both, vector_batches
from test_engine_gpu_state import device, placement_kw

PLAN = ExecutePlan.from_cuts(7, forward=[2, 5], backward=[1, 3, 5])
WEIGHT_BYTES = 4 * sum(p.numel() for p in mlp().parameters())  # fp32


def live_copy(engine: RoundPipe) -> list[torch.Tensor]:
    """The first GPU's live compute copy: one flat tensor per dtype (resident.py)."""
    return [t for _, t in engine._executor.store.resident[0].live.pieces]


def live_views(engine: RoundPipe) -> list[torch.Tensor]:
    """The first GPU's live copy of every trainable parameter, shaped like it."""
    live = engine._executor.store.resident[0].live
    return [live.view(slot) for slot in engine._host.params.slots]


def shows_host_tensors(engine: RoundPipe) -> bool:
    """The user's parameters stay on the host, sharing no memory with the GPU's copy (the original library's placement)."""
    storages = {t.untyped_storage().data_ptr() for t in live_copy(engine)}
    return all(p.device.type == "cpu" and p.untyped_storage().data_ptr() not in storages for p in engine.model.parameters())


def predicted_matches_report(engine: RoundPipe) -> None:
    """fit.py's prediction, made before allocating, against what the engine's host holds (both
    gradient buffers allocated by async steps), exactly. (The optimizer's state is left out: on a
    SimulatedDevice its GPU share lives in CPU tensors too.)"""
    predicted, report = engine.placement.totals[HOST], engine.memory_report()
    assert len(engine._host.grads) == 2
    for kind in ("master", "grads", "compute", "buffers"):
        assert predicted[kind] == report[kind], (kind, predicted[kind], report[kind])


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["gpu", "split", "host"])
def test_resident_engine_has_no_host_compute_copies(where, delayed):
    """Every placement of a resident engine: no host compute copy predicted or allocated, training
    matches plain PyTorch, and the model's parameters stay host tensors showing the master of the last
    synchronize() (until the next one). Eval forward matches the reference's model at the version of
    the newest call (one step stale after an async step)."""
    kw = placement_kw(where, mlp())
    batches = vector_batches(count=4)
    engine, ref = train_both(mlp(), batches[:3], 2, plan=PLAN, delayed=delayed, devices=[device()], **kw)
    host = engine._host
    assert engine._executor.resident and host.compute is None
    assert engine.memory_report()["compute"] == 0 and engine.placement.totals[HOST]["compute"] == 0
    assert "host: no compute copies" in str(engine.placement)
    assert {"gpu": host.gpu is not None and not host.host.ranges(), "split": bool(host.gpu and host.host.ranges()),
            "host": host.gpu is None}[where]
    assert shows_host_tensors(engine)
    state = {k: v.clone() for k, v in engine.state_dict().items()}  # on the CPU state_dict() may alias the master
    assert_state_close(state, ref.state())
    for name, p in engine.model.named_parameters():  # after synchronize(): the master (fp32: exactly)
        assert torch.equal(p.detach().cpu(), state[name]), name

    # One more step: async calls then run one version behind the master, sync ones at it.
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)  # a fresh optimizer on both sides: the reference's is reset below
    ref.opt = torch.optim.Adam(ref.master.parameters(), lr=1e-2, fused=True)
    with torch.no_grad():  # synchronize() made the engine's compute copy the master: the reference's too
        for pc, pm in zip(ref.compute.parameters(), ref.master.parameters()):
            pc.copy_(pm)
    x, y = batches[3]
    loss = engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN))
    assert loss.item() == pytest.approx(ref.forward_backward(x, y, 2, nn.CrossEntropyLoss()), rel=1e-5, abs=1e-6)
    engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=delayed)
    ref.step()
    engine.eval()
    with torch.no_grad():  # the reference's compute copy: the newest master (sync) or the one before (async)
        torch.testing.assert_close(engine(x).cpu(), ref.compute(x.to(ref.device)).cpu(), rtol=1e-5, atol=1e-6)
    for name, p in engine.model.named_parameters():  # the last synchronize()'s weights until the next one
        assert torch.equal(p.detach().cpu(), state[name]), name
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())
    engine.close()


def test_prediction_matches_report_with_and_without_host_copies():
    """Split placement, async steps: fit.py predicts the host's bytes per kind exactly, for the
    default (no host copies) and for ``refresh_gpu_share`` below 1, where the host casts part of
    each version into two compute copies of its share (2 x 4 bytes per fp32 parameter)."""
    for share in (1.0, 0.5):
        kw = placement_kw("split", mlp())
        kw["tuning"] = Tuning(gpu_state_reserve=0.0, refresh_gpu_share=share)
        engine, ref = train_both(mlp(), vector_batches(count=3), 2, plan=PLAN, delayed=True, devices=[device()], **kw)
        with OptimizerCtx():
            opt = Adam(engine.parameters(), lr=1e-2)
        engine.forward_backward(input_args=vector_batches(count=1)[0][:1], loss_fn=lambda out, _: out.square().mean())
        engine.step(lambda: (opt.step(), opt.zero_grad()))
        engine.forward_backward(input_args=vector_batches(count=1)[0][:1], loss_fn=lambda out, _: out.square().mean())
        host = engine._host
        n = sum(r.numel for r in host.host.ranges())
        assert engine._executor.resident and host.gpu is not None and n > 0
        assert engine.memory_report()["compute"] == (0 if share == 1.0 else 2 * 4 * n)
        predicted_matches_report(engine)
        engine.close()


def test_streamed_engine_keeps_its_host_copies():
    """A GPU too small to keep the model resident streams each stage from the host's compute copies:
    there the host keeps two, and training still matches plain PyTorch one step stale."""
    small = SimulatedDevice(0, memory=3 * WEIGHT_BYTES)  # two versions exceed Tuning.resident_share_gpu_state of it
    engine, ref = train_both(mlp(), vector_batches(count=3), 2, plan=PLAN, delayed=True, devices=[small])
    assert not engine._executor.resident and engine._host.compute is not None and "no compute copies" not in str(engine.placement)
    copies = 2 * 4 * engine._host.params.sizes["float32"]  # every tensor's padding to 256 bytes included
    assert copies >= 2 * WEIGHT_BYTES and engine.memory_report()["compute"] == copies == engine.placement.totals[HOST]["compute"]
    assert_state_close(engine.state_dict(), ref.state())
    engine.close()


def test_two_resident_gpus_match_pytorch_without_host_copies():
    """Several resident GPUs each cast every version from the master. Version 0 is staged on every
    GPU when the engine is made: no host copy keeps it once a step has changed the master."""
    fresh = RoundPipe(mlp(), devices=[SimulatedDevice(0), SimulatedDevice(1)])
    assert all(0 in r.staged for r in fresh._executor.store.resident.values()) and len(fresh._executor.store.resident) == 2
    fresh.close()
    devices = [SimulatedDevice(0), SimulatedDevice(1)]
    engine, ref = train_both(mlp(), vector_batches(count=4), 3, plan=PLAN, delayed=True, devices=devices)
    assert engine._executor.resident and engine._host.compute is None and engine.memory_report()["compute"] == 0
    assert set(engine._executor.store.resident) == {0, 1} and shows_host_tensors(engine)
    assert_state_close(engine.state_dict(), ref.state())
    engine.close()


def test_a_failed_staging_is_restaged_from_a_whole_master(monkeypatch):
    """A step whose staging fails (say the GPU has no memory left) reports it at the next call; a later
    call that needs that version stages it from the master. If the user has stepped again by then, that
    step may be halfway through changing the master: the restaging waits for it to finish, so no call
    reads half an update (every weight of the copy it gets is one whole version of the master)."""
    from rptrain.engine import resident

    engine = RoundPipe(mlp(), devices=[SimulatedDevice(0)], gpu_state=False)
    assert engine._executor.resident and engine._host.compute is None
    masters = list(engine.optim_parameters())
    start = [p.detach().clone() for p in masters]
    x, y = vector_batches(count=1)[0]
    call = lambda: engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss())
    stage, failed = resident.refresh.stage_version, []

    def stage_once_failing(host, devices, version, plan):
        if version == 1 and not failed:
            failed.append(version)
            raise RuntimeError("simulated: no GPU memory left to stage version 1")
        return stage(host, devices, version, plan)

    def add(params, amount):
        with torch.no_grad():
            for p in params:
                p.add_(amount)

    def slow_step():  # half the master, a pause, the other half
        add(masters[: len(masters) // 2], 10.0)
        time.sleep(0.5)
        add(masters[len(masters) // 2 :], 10.0)

    monkeypatch.setattr(resident.refresh, "stage_version", stage_once_failing)
    call()
    engine.step(lambda: add(masters, 1.0))  # writes version 1; its staging fails
    engine.wait_for_steps()
    with pytest.raises(RuntimeError, match="no GPU memory left"):
        call()  # the error, reported before anything runs
    call()  # the user carries on; one step stale: version 0
    engine.step(slow_step)  # version 2
    time.sleep(0.1)  # the step is in its pause now
    call()  # needs version 1: staged from the master now
    shown = [p - s for p, s in zip(live_views(engine), start)]
    deltas = {round(float(d.min()), 4) for d in shown} | {round(float(d.max()), 4) for d in shown}
    assert failed and len(deltas) == 1 and deltas <= {1.0, 11.0}, deltas
    engine.synchronize()
    for p, s in zip(engine.model.parameters(), start):
        torch.testing.assert_close(p.detach(), s + 11.0)
    engine.close()

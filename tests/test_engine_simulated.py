"""The engine's GPU paths on the CPU (rptrain/engine/simulated.py): resident weights, prefetch,
CUDA-graph decisions, activation offload, buffer write-back and early gradient sends, each
against plain PyTorch (tests/reference.py) at the equivalence suite's tolerance (fp32: rtol 1e-5)."""
from __future__ import annotations

import pytest
import torch

from reference import assert_state_close, ran_as_one_batch
from rptrain import ExecutePlan, Tuning
from rptrain.engine.simulated import OrderingError, SimulatedDevice
from test_engine_equivalence import convnet, image_batches, train_both

SMALL = 50_000  # bytes of "GPU": enough for one stage, too little to keep the convnet resident: every stage streams


def sims(count: int, memory: int = 1 << 30) -> list[SimulatedDevice]:
    return [SimulatedDevice(i, memory) for i in range(count)]


STAGED = Tuning(whole_call_graphs=False)  # stage graphs instead of the whole call's (tests/test_engine_whole_call.py)


@pytest.mark.parametrize("delayed", [False, True])
def test_resident_measured_plan_and_graphs_match(delayed):
    """Resident weights, the measured first call and the graph bookkeeping of the fused stage."""
    engine, ref = train_both(convnet(), image_batches(), 2, devices=sims(1), delayed=delayed, tuning=STAGED)
    assert engine._executor.resident and engine.plan is not None
    assert_state_close(engine.state_dict(), ref.state())
    [graphs] = engine._executor._graphs.values()
    assert len(graphs._graphs) == 1 and graphs.replays(next(iter(graphs._graphs)))  # one input shape, recorded once


@pytest.mark.parametrize("offload", [False, True])
def test_streamed_prefetched_stages_match(offload):
    plan = ExecutePlan.from_cuts(10, [4, 7], [3, 7])
    engine, ref = train_both(convnet(), image_batches(), 2, plan=plan, devices=sims(1, SMALL),
                             tuning=Tuning(offload_activations=offload), gpu_state=False)  # GPU state would keep it resident
    assert not engine._executor.resident
    assert_state_close(engine.state_dict(), ref.state())


def test_two_simulated_devices_match():
    plan = ExecutePlan.from_cuts(10, [3, 6], [2, 6])
    engine, ref = train_both(convnet(), image_batches(), 3, plan=plan, devices=sims(2, SMALL), grain="layer")
    assert_state_close(engine.state_dict(), ref.state())


def _thread_count_of_a_new_thread() -> int:
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_an_optimizer_thread_leaves_later_engines_thread_counts_alone():
    """An engine's optimizer thread runs its own OpenMP thread count; torch.set_num_threads there also
    set the count every later thread starts with, so a second engine's device threads summed with a
    different count than plain PyTorch (0.weight off by 8e-4). Two engines in one process, in that order."""
    threads = torch.get_num_threads()
    first, _ = train_both(convnet(), image_batches(count=1), 2, devices=sims(1), delayed=True, optimizer_threads=threads + 1)
    first.close()
    assert _thread_count_of_a_new_thread() == threads
    test_two_simulated_devices_match()


def test_reading_an_upload_without_waiting_is_an_ordering_error():
    device = SimulatedDevice(0)
    with device.stream("upload"):
        t = device.upload(torch.ones(3))
        event = device.record("upload")
    with pytest.raises(OrderingError, match="without waiting"):
        device.check_ready("compute", [t])
    device.wait("compute", event)
    device.check_ready("compute", [t])
    with pytest.raises(OrderingError, match="upload on the 'compute' stream"):
        device.upload(torch.ones(3))
    with pytest.raises(OrderingError, match="which no stream recorded"):
        device.wait("compute", object())
    # Happens-before is transitive: download waited on compute, which waited on the upload.
    with device.stream("upload"):
        later = device.upload(torch.ones(3))
        uploaded = device.record("upload")
    with pytest.raises(OrderingError, match="'download' stream of device 0 reads a tensor written on the 'upload'"):
        device.check_ready("download", [later[1:]])  # a view of it
    device.wait("compute", uploaded)
    device.wait("download", device.record("compute"))
    with device.stream("download"):
        device.copy_to_host(torch.empty(2), later[1:])
    grads = device.zeros(4, torch.float32)  # written on the compute stream
    with device.stream("download"), pytest.raises(OrderingError, match="written on the 'compute'"):
        device.copy_to_host(torch.empty(4), grads)


class _SquaredMean(torch.nn.Module):
    def forward(self, x):
        return x.pow(2).mean()


@pytest.mark.parametrize("whole", [False, True])
def test_a_replayed_stage_returning_its_own_output_as_the_loss_keeps_each_microbatch(whole):
    """A replay hands back the same memory every time (as a CUDA graph does): an identity loss_fn's
    per-microbatch losses must be copied before the next replay overwrites them (exact: same kernels);
    a stage's graphs and a whole call's alike."""
    from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _SquaredMean())
    x = torch.randn(6, 4)
    expected = sum(model(chunk) for chunk in x.chunk(2)).item()
    engine = RoundPipe(model, devices=sims(1), model_run_config=RoundPipeRunConfig(num_microbatch=2), tuning=Tuning(whole_call_graphs=whole))
    with OptimizerCtx():
        torch.optim.SGD(engine.parameters(), lr=0.0)
    for _ in range(3):  # the first call measures, the next record and replay
        loss = engine.forward_backward(input_args=(x,), loss_fn=lambda out, _: out)
        assert loss.item() == pytest.approx(expected, rel=1e-6)
    if whole:
        [graphs] = engine._executor._whole.values()
        assert len(graphs._recorded) == 1 and graphs.fallback is None
    else:
        [graphs] = engine._executor._graphs.values()
        assert graphs.replays(next(iter(graphs._graphs)))
    engine.close()


def test_autograd_calls_on_two_streamed_devices_match():
    """``criterion(model(x), y).backward()`` (recorded.py: a forward call saving for a backward call)
    on two simulated GPUs that stream their stages, against plain PyTorch (rtol 1e-5)."""
    from reference import Reference
    from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
    from rptrain.optim import Adam
    from test_engine_equivalence import mlp, vector_batches

    engine = RoundPipe(mlp(), devices=sims(2, SMALL))
    assert not engine._executor.resident
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    ref = Reference(mlp(), lr=1e-2)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=ExecutePlan.from_cuts(7, [2, 5], [1, 3, 5]))
    ce = torch.nn.CrossEntropyLoss()
    for x, y in vector_batches(count=3):
        loss = ce(engine(x, run_config=cfg), y)
        loss.backward()
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        assert loss.item() == pytest.approx(ref.forward_backward(x, y, 1, ce), rel=1e-5)
        ref.step()
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())
    engine.close()


@pytest.mark.parametrize("rate", [1.0, 1e15, None])
def test_a_streamed_engine_plans_with_its_transfer_rate(rate):
    """Streamed weights: the measured plan balances bytes at Tuning.transfer_rate as well as compute (1 byte/s: the
    uploads decide it; None: compute alone). Resident weights move nothing per stage: compute alone."""
    from rptrain.engine.plan import plan_stages

    engine, ref = train_both(convnet(), image_batches(2), 2, devices=sims(1, SMALL), tuning=Tuning(transfer_rate=rate), gpu_state=False)
    planner = engine._planner
    assert not engine._executor.resident and planner.costs is not None and planner.transfer_rate == rate
    assert engine.plan == plan_stages(planner.costs, 1, planner.memory_cap or None, rate)
    assert_state_close(engine.state_dict(), ref.state())
    resident, _ = train_both(convnet(), image_batches(1), 2, devices=sims(1), tuning=Tuning(transfer_rate=rate))
    assert resident._executor.resident and resident._planner.transfer_rate is None


def test_a_joined_measuring_call_offloads_as_one_measured_apart():
    """A first call measured with its microbatches joined (fused_call.py) measured the whole batch's saved
    inputs; the offload decision counts them once, so it is the same as an engine that measured them apart."""
    import dataclasses

    from rptrain import RoundPipeRunConfig

    two = RoundPipeRunConfig(num_microbatch=2)
    streamed = dict(model_run_config=two, gpu_state=False)  # stages that save their inputs
    joined, _ = train_both(convnet(), image_batches(1), 2, devices=sims(1, SMALL), **streamed)
    apart, _ = train_both(convnet(), image_batches(1), 2, devices=sims(1, SMALL), tuning=Tuning(fuse_microbatches=False), **streamed)
    assert joined._planner.measured_joined and not apart._planner.measured_joined
    x = image_batches(1)[0][0]
    assert "for the joined batch)" in joined.explain(x) and "per microbatch)" in apart.explain(x)  # what the saved bytes are
    apart._planner.plan = joined._planner.plan  # the joined measurement's larger graphs cut other stages: compare one plan
    decisions = []
    for share in (k / 20 for k in range(1, 21)):  # from offloading to keeping the saved inputs (about the 50 kB cap)
        for engine in (joined, apart):
            engine._planner.tuning = dataclasses.replace(engine._planner.tuning, offload_share=share)
        decisions.append((joined._prepare.training(None).offload, apart._prepare.training(None).offload))
    assert all(a == b for a, b in decisions) and {a for a, _ in decisions} == {True, False}, decisions
    joined.close(), apart.close()


def test_microbatches_whose_joined_layer_is_over_the_memory_cap_run_apart_after_the_measuring_call():
    """The first call measures the microbatches joined; where one layer's joined graph is over the GPU's cap but
    one microbatch's is not, the plan is made for the microbatches apart and every later call runs them apart
    (the engine trains as with Tuning(fuse_microbatches=False) rather than refusing the model), matching PyTorch."""
    from rptrain import RoundPipeRunConfig

    two = RoundPipeRunConfig(num_microbatch=2)
    engine, ref = train_both(convnet(), image_batches(3), 2, devices=sims(1, SMALL), model_run_config=two)
    assert engine._planner.keeps_apart and not ran_as_one_batch(engine)
    assert "apart: a layer's activations for the joined batch do not fit the GPU's memory cap" in engine.explain(image_batches(1)[0][0])
    assert_state_close(engine.state_dict(), ref.state())
    engine.close()

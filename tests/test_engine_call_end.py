"""How a call ends (executor.py's ``_host_waits``): the caller waits for the devices only where the host
reads something the call made (a GradScaler's inf/NaN verdict, gradients landing in host memory, outputs
copied to another device, a profile); otherwise the device only orders the caller's later work after the
call (``join_caller``: on a GPU, stream waits). Issue 33: that wait kept host issue and GPU work from
overlapping. Counted on a SimulatedDevice; the numbers stay plain PyTorch's either way (the equivalence
tests run both paths)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rptrain import GradScaler, RoundPipeRunConfig, Tuning
from rptrain.engine.simulated import SimulatedDevice
from test_engine_equivalence import make_engine, mlp, train_both, vector_batches

RESIDENT = Tuning(resident_share=1.0, resident_share_gpu_state=1.0, gpu_state_reserve=0.0)


class Counting(SimulatedDevice):
    def __init__(self, index: int):
        super().__init__(index)
        self.ends = []

    def synchronize(self) -> None:
        self.ends.append("wait")
        super().synchronize()

    def join_caller(self) -> tuple:  # (the base class's waits: a device without streams has nothing to order)
        self.ends.append("join")
        return ()  # what a GPU returns is its streams' end events: none here


def ends_of(engine, device: Counting, **call) -> list[str]:
    x, y = vector_batches(count=1)[0]
    device.ends.clear()
    engine.forward_backward(input_args=(x,), label=y, loss_fn=call.pop("loss_fn", nn.CrossEntropyLoss()),
                            run_config=RoundPipeRunConfig(num_microbatch=2, **call))
    return device.ends


def test_a_call_the_host_reads_nothing_of_ends_without_waiting():
    device = Counting(0)
    engine, _ = make_engine(mlp(), devices=[device], tuning=RESIDENT)
    assert engine.placement.params_on("host") == 0 and engine._executor.resident
    ends_of(engine, device)  # the first call profiles its stages: the host reads the timings
    assert ends_of(engine, device) == ["join"]  # outputs stay where the call ran (the simulated GPU's tensors)
    scaler = GradScaler()
    assert "wait" in ends_of(engine, device, loss_fn=lambda out, lab: scaler.scale(nn.functional.cross_entropy(out, lab)))


def test_a_call_whose_gradients_land_on_the_host_waits():
    device = Counting(0)
    engine, _ = make_engine(mlp(), devices=[device], tuning=RESIDENT, gpu_state=False)
    ends_of(engine, device)
    assert ends_of(engine, device) == ["wait"]


def test_training_that_ends_calls_without_waiting_equals_plain_pytorch():
    engine, _ = train_both(mlp(), vector_batches(count=4), 2, delayed=True, devices=[Counting(0)], tuning=RESIDENT)
    assert engine._executor.resident and engine.placement.params_on("host") == 0


def test_the_step_of_such_calls_leaves_its_gpu_work_to_the_next_call():
    """After calls that ended with ``join_caller`` the optimizer thread marks its GPU work with an event the
    next call's streams wait on (``Executor.step_done``) instead of waiting for it; after a call the host
    waited for, it waits for its GPU work itself (``wait_queued``)."""
    device = Counting(0)
    engine, opt = make_engine(mlp(), devices=[device], tuning=RESIDENT)
    marked, waited = [], []
    engine._executor.step_done = lambda buffer: marked.append(True)
    engine._host.gpu.wait_queued = lambda: waited.append(True)
    for _ in range(3):
        ends_of(engine, device)
        engine.step(lambda: (opt.step(), opt.zero_grad()))
    engine.wait_for_steps()
    assert waited == [True] and marked == [True, True]  # the first call profiled (a host wait), the others joined


class Stepping(Counting):
    """Numbers its step events and remembers which the calls followed."""

    def __init__(self, index: int):
        super().__init__(index)
        self.marked, self.followed = 0, []

    def step_event(self):
        self.marked += 1
        return self.marked

    def follow_step(self, event) -> None:
        self.followed.append(event)


def test_a_training_call_follows_the_step_that_read_its_buffer_not_the_newest():
    """With two versions, call k+1 writes the other gradient buffer than step k reads: it follows step k-1 (which
    read that buffer), so step k's GPU work overlaps it. Forward-only calls follow the newest step."""
    device = Stepping(0)
    engine, opt = make_engine(mlp(), devices=[device], tuning=RESIDENT)
    for _ in range(4):
        ends_of(engine, device)
        engine.step(lambda: (opt.step(), opt.zero_grad()))
        engine.wait_for_steps()  # (each step's event is marked before the next call: the order is fixed)
    # Step 1 follows call 1, which profiled its stages (a host wait): no event. Steps 2 and 3 mark events 1 and 2,
    # reading buffers B and A. Call 3 writes A (last read by step 1: nothing to follow), call 4 writes B (step 2,
    # event 1); following the newest step would have been [None, None, 1, 2].
    assert device.followed == [None, None, None, 1]
    x, _ = vector_batches(count=1)[0]
    engine.forward(x)
    assert device.followed[-1] == device.marked

"""A call overlapping the step that writes its weights (one version, streamed weights: versions.py, front.py).

The overlapped call must train bit for bit as if it had waited for the whole step (``Tuning.step_overlap``
False), start before the step ends, read no stage before the step has written it, and report the step's
error. On a SimulatedDevice (the CUDA code paths on the CPU) with the low-precision AdamW; the bit-for-bit test
also on a real GPU where there is one (its events and streams, not simulated ones).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from rptrain import RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine.optimizer_ctx import OptimizerCtx
from rptrain.engine.simulated import SimulatedDevice
from rptrain.optim import AdamW, adam_lowp, front
from rptrain.optim.assist import Assist, assisting
from rptrain.optim.lowbit import BLOCK
from rptrain.optim.state import state_memory_of


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def device_of(where: str):
    # "gpu share": a simulated GPU with room for the state of the first two layers (Linear, Tanh), the host the rest
    return {"simulated": SimulatedDevice(0), "gpu share": SimulatedDevice(0, memory=60_000)}.get(where, "cuda:0")


def engine_and_optimizer(overlap: bool, share: float = 0.0, where: str = "simulated"):
    tuning = Tuning(resident_share=0.0, resident_share_gpu_state=0.0, host_step_gpu_share=share, step_overlap=overlap,
                    gpu_state_reserve=0.0, streamed_gpu_state_reserve=0.0)
    engine = RoundPipe(mlp().to(torch.bfloat16), optim_dtype=torch.bfloat16, devices=[device_of(where)], tuning=tuning,
                       gpu_state=where == "gpu share", single_version=True,
                       optimizer=state_memory_of(AdamW, torch.bfloat16, state_dtype="int8"))
    assert engine.placement.gpu_layers == (2 if where == "gpu share" else 0)
    with OptimizerCtx():
        opt = AdamW(engine.parameters(), lr=1e-2, state_dtype="int8", compile_step=False)
    return engine, opt


def batches(count: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g).bfloat16(), torch.randint(0, 5, (8,), generator=g)) for _ in range(count)]


def loss_fn(outputs, target):
    return nn.functional.cross_entropy(outputs.float(), target)


def train(overlap: bool, step_fn_of, share: float = 0.0, where: str = "simulated"):
    engine, opt = engine_and_optimizer(overlap, share, where)
    losses = []
    for x, y in batches():
        losses.append(engine.forward_backward((x,), label=y, loss_fn=loss_fn, run_config=RoundPipeRunConfig(num_microbatch=2)).item())
        engine.step(step_fn_of(opt))
    engine.synchronize()
    return engine, losses, [p.detach().clone() for p in engine.parameters()]


def slow_step(opt, before: float = 0.15, after: float = 0.0):
    def step() -> None:
        time.sleep(before)  # an overlapped call that read a stage before the step wrote it would see old weights
        opt.step()
        time.sleep(after)
        opt.zero_grad()
    return step


@pytest.mark.parametrize("where", ["simulated", "gpu share", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_an_overlapped_call_trains_bit_for_bit_as_one_that_waited(share, where):
    engine, losses, weights = train(True, slow_step, share, where)
    assert engine._versions.overlaps(True) and engine._versions.front is None
    _, ref_losses, ref_weights = train(False, slow_step, share, where)
    assert losses == ref_losses
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_next_call_starts_before_the_step_ends():
    """The step writes every weight, then takes a while more: the next call's forward runs meanwhile
    (overlap on), or only after it (overlap off). Its gradients still land after the step (one buffer)."""
    for overlap in (True, False):
        engine, opt = engine_and_optimizer(overlap)
        marks: dict[str, float] = {}
        step_fn = slow_step(opt, before=0.0, after=0.4)

        def timed_step() -> None:
            step_fn()
            marks["step_end"] = time.perf_counter()

        (x, y), (x2, y2) = batches(2)
        engine.forward_backward((x,), label=y, loss_fn=loss_fn)
        engine.step(timed_step)

        def timed_loss(outputs, target):  # the last stage's forward is done: every weight of the call was read
            marks.setdefault("loss", time.perf_counter())
            return loss_fn(outputs, target)

        engine.forward_backward((x2,), label=y2, loss_fn=timed_loss)
        assert "step_end" in marks  # the call returned after the step: its gradients went into the step's buffer after it
        if overlap:
            assert marks["loss"] < marks["step_end"] - 0.2, "the call's forward waited for the whole step"
        else:
            assert marks["loss"] >= marks["step_end"]
        engine.close()


def test_the_step_error_is_the_overlapping_calls():
    engine, opt = engine_and_optimizer(True)
    (x, y), (x2, y2), (x3, y3) = batches(3)

    def failing() -> None:
        opt.step()
        raise ValueError("boom after the update")

    engine.forward_backward((x,), label=y, loss_fn=loss_fn)
    engine.step(failing)
    with pytest.raises(RuntimeError, match="optimizer step failed.*boom"):
        engine.forward_backward((x2,), label=y2, loss_fn=loss_fn)
    engine.close()


class RecordingFront(front.StepFront):
    def __init__(self):
        super().__init__(1)
        self.spans: list[tuple[int, int]] = []

    def done(self, t, event=None):
        self.spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        super().done(t, event)


@pytest.mark.parametrize("assisted", [False, True])
def test_a_host_run_reports_its_pieces_and_steps_bit_for_bit(monkeypatch, assisted):
    """A host run stepped for a call that overlaps it reports pieces (and an assisted part, chunks) as
    they end; the result is the unreported step's exactly."""
    monkeypatch.setattr(adam_lowp, "FRONT_PIECE", 4 * BLOCK)
    numel = 20 * BLOCK + 7

    def stepped(tracked: bool):
        torch.manual_seed(3)
        p = nn.Parameter(torch.randn(numel).bfloat16())
        p.grad = torch.randn(numel).bfloat16()
        opt = AdamW([p], lr=1e-2, state_dtype="int8", compile_step=False)
        recorder = RecordingFront() if tracked else None
        helper = Assist(torch.device("cpu"), 0.5, chunk=3 * BLOCK) if assisted else None
        for _ in range(2):
            with front.tracking(recorder), assisting(helper):
                opt.step()
        return p.detach().clone(), recorder, p

    reference, _, _ = stepped(False)
    result, recorder, p = stepped(True)
    torch.testing.assert_close(result, reference, rtol=0, atol=0)
    assert len(recorder.spans) > 2  # pieces, not the run once
    recorder.finished = False
    assert recorder._covered(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())


def test_the_front_merges_ranges_and_waits_for_exactly_what_is_read():
    base = torch.zeros(100)
    f = front.StepFront(1)
    for a, b in ((40, 60), (0, 10), (10, 20), (70, 80), (55, 72)):
        f.done(base[a:b], event=("e", a) if a == 70 else None)
    assert len(f._starts) == 2  # [0, 20) and [40, 80)
    assert f.wait(base[0:20]) == [] and f.wait(base[45:75]) == [("e", 70)]
    reader_saw: list[bool] = []
    reader = threading.Thread(target=lambda: reader_saw.append(bool(f.wait(base[15:95]) is not None)))
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive()  # [20, 40) and [80, 95) are not done
    f.done(base[20:40])
    time.sleep(0.05)
    assert reader.is_alive()
    f.finish()  # the step ended: what nobody reported is done too
    reader.join(timeout=5)
    assert not reader.is_alive() and reader_saw == [True]

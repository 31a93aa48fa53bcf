"""A small run's checkpoint written while training goes on (run_checkpoints.RunCheckpoints.save(background=True)).

The loop hands the write to a thread and trains on; what is written is the state at the step it was taken
(a copy), one write is in flight at a time, a failed write is raised by the next save or wait (and the step
on disk is the one before), and a run's first checkpoint (none on disk to fall back on) and a state over
BACKGROUND_MAX_BYTES are written before save returns.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rptrain.train import checkpoint as ckpt
from rptrain.train import run_checkpoints
from rptrain.train.dist import Dist
from rptrain.train.errors import OutputError
from rptrain.train.meters import RunProgress

FP = {"model": "tiny", "params": 4, "shapes": "x"}


class Engine:
    def __init__(self):
        self.weight = torch.arange(4.0)

    def synchronize(self) -> None:
        pass

    def master_state(self) -> dict:
        return {"weight": self.weight}  # the live tensor, as the engine hands it over (nothing copied)


def stubs():
    stateless = SimpleNamespace(state_dict=lambda: {})
    data = SimpleNamespace(train=SimpleNamespace(state_dict=lambda: {"next_batch": 0}))
    metrics = SimpleNamespace(records=[], write_csv=lambda: None)
    return Engine(), stateless, data, metrics


def checkpoints(tmp_path) -> run_checkpoints.RunCheckpoints:
    cfg = OmegaConf.create({"trainer": {"keep_checkpoints": 3}})
    return run_checkpoints.RunCheckpoints(cfg, tmp_path / "run", [], FP, Dist(), {"weight"})


def slow_writes(monkeypatch, seconds: float, fail_step: int = -1) -> threading.Event:
    """save_rotating, late by ``seconds`` (and failing with ENOSPC at ``fail_step``); the event is set as it starts."""
    started, real = threading.Event(), ckpt.save_rotating

    def save_rotating(directory, state, step, keep):
        started.set()
        time.sleep(seconds)
        if step == fail_step:
            raise OutputError(f"cannot write checkpoint step {step}: No space left on device (ENOSPC)")
        return real(directory, state, step, keep)
    monkeypatch.setattr(run_checkpoints, "save_rotating", save_rotating)
    return started


def test_the_loop_goes_on_while_the_write_runs_and_the_file_holds_the_step_it_was_taken_at(tmp_path, monkeypatch):
    started = slow_writes(monkeypatch, 0.5)
    c, (engine, stateless, data, metrics) = checkpoints(tmp_path), stubs()
    c.save(RunProgress(step=1), engine, stateless, stateless, stateless, data, metrics, background=True)
    assert c._pending is None  # the run's first: written before save returned (a second signal would leave none)
    engine.weight.sub_(100)
    started.clear()
    t0 = time.perf_counter()
    c.save(RunProgress(step=2), engine, stateless, stateless, stateless, data, metrics, background=True)
    assert time.perf_counter() - t0 < 0.4, "save waited for the write"
    engine.weight.add_(100)  # training goes on, in place, while the write is in flight
    assert started.wait(5)
    c.wait()
    state = ckpt.load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt", FP)
    assert torch.equal(state["model"]["weight"], torch.arange(4.0) - 100) and state["progress"]["step"] == 2
    c.close()


def test_a_failed_background_write_is_raised_by_the_next_save_and_the_step_before_stays(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.0, fail_step=2)
    c, (engine, stateless, data, metrics) = checkpoints(tmp_path), stubs()
    c.save(RunProgress(step=1), engine, stateless, stateless, stateless, data, metrics, background=True)
    c.save(RunProgress(step=2), engine, stateless, stateless, stateless, data, metrics, background=True)
    with pytest.raises(OutputError, match="step 2: No space left"):
        c.save(RunProgress(step=3), engine, stateless, stateless, stateless, data, metrics, background=True)
    assert c.last_step == 1 and "step 1" in c.kept()
    assert ckpt.load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt", FP)["progress"]["step"] == 1
    c.close()


def test_a_state_over_the_limit_and_a_last_checkpoint_are_written_before_save_returns(tmp_path, monkeypatch):
    slow_writes(monkeypatch, 0.3)
    monkeypatch.setattr(run_checkpoints, "BACKGROUND_MAX_BYTES", 1024)  # the stub's state takes more (a MiB of slack)
    c, (engine, stateless, data, metrics) = checkpoints(tmp_path), stubs()
    c.save(RunProgress(step=1), engine, stateless, stateless, stateless, data, metrics)  # a first checkpoint on disk
    c.save(RunProgress(step=2), engine, stateless, stateless, stateless, data, metrics, background=True)
    assert c._pending is None  # written from where it lives: no copy of a large state
    monkeypatch.setattr(run_checkpoints, "BACKGROUND_MAX_BYTES", 2**30)
    c.save(RunProgress(step=3), engine, stateless, stateless, stateless, data, metrics)  # background=False: a run's last
    assert c._pending is None
    assert ckpt.load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt", FP)["progress"]["step"] == 3
    c.close()
    assert not any(t.name.startswith("rptrain-checkpoint") for t in threading.enumerate())


def test_a_snapshot_copies_tensors_once_and_rebuilds_containers():
    from collections import OrderedDict

    shared = torch.ones(3)
    state = {"a": shared, "b": [shared, 1, "x"], "c": (torch.zeros(2),), "d": OrderedDict(w=shared), "e": torch.Size([2, 3])}
    state["f"] = shared.view(3)  # another object for the same stored tensor (a tied weight): copied once too
    copy = ckpt.snapshot(state)
    assert copy["a"] is copy["b"][0] is copy["d"]["w"] is copy["f"] and copy["a"] is not shared and torch.equal(copy["a"], shared)
    assert copy["b"] is not state["b"] and isinstance(copy["c"], tuple) and copy["b"][1:] == [1, "x"]
    assert type(copy["d"]) is OrderedDict and type(copy["e"]) is torch.Size and copy["e"] == (2, 3)
    shared.add_(1)
    assert torch.equal(copy["a"], torch.ones(3))


def test_a_run_s_snapshots_reuse_one_host_memory():
    """The second snapshot lands where the first did (no fresh memory at every epoch's end), each holds the
    state as it was when taken, and a larger state gets a larger memory."""
    memory = ckpt.SnapshotMemory()
    w, m = torch.arange(10.0), torch.ones(3, 2, dtype=torch.bfloat16).t()  # a transposed (non-contiguous) tensor
    first = ckpt.snapshot({"w": w, "m": m, "flag": torch.tensor(True), "empty": torch.zeros(0, 4)}, memory)
    assert torch.equal(first["w"], w) and torch.equal(first["m"], m) and first["flag"].item() is True
    assert first["empty"].shape == (0, 4) and first["m"].is_contiguous()
    place = first["w"].data_ptr()
    w.add_(1)
    assert torch.equal(first["w"], torch.arange(10.0))  # a copy, not the live tensor
    second = ckpt.snapshot({"w": w, "m": m, "flag": torch.tensor(False), "empty": torch.zeros(0, 4)}, memory)
    assert second["w"].data_ptr() == place and torch.equal(second["w"], w) and second["flag"].item() is False
    third = ckpt.snapshot({"w": torch.ones(10_000)}, memory)
    assert torch.equal(third["w"], torch.ones(10_000))


@pytest.mark.cuda
def test_a_snapshot_of_gpu_tensors_is_pinned_and_complete():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    memory = ckpt.SnapshotMemory()
    w = torch.randn(1_000_000, device="cuda")
    copy = ckpt.snapshot({"w": w, "cpu": torch.ones(3)}, memory)
    assert copy["w"].device.type == "cpu" and copy["w"].is_pinned() and torch.equal(copy["w"], w.cpu())
    assert torch.equal(copy["cpu"], torch.ones(3))

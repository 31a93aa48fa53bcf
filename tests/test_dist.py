"""Data parallelism over torch.distributed (gloo on CPU), launched the way users launch it: torchrun."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import dist_worker  # noqa: E402

from rptrain import OptimizerCtx, RoundPipe  # noqa: E402
from rptrain.optim import Adam  # noqa: E402
from rptrain.train.dist import say  # noqa: E402


def torchrun(out: Path, *extra: str, nproc: int = 2, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "dist_worker.py"), str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["host", "gpu_state"])
def test_two_ranks_equal_one_process_on_the_whole_batch(tmp_path, where):
    """gpu_state: each rank's master, gradients and optimizer state on a SimulatedDevice (gpushare.py),
    averaged by the same reduction."""
    result = torchrun(tmp_path, *(["--simulated"] if where == "gpu_state" else []))
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name  # identical on every rank
    # One process, the whole global batch, the same loss normalisation.
    engine = RoundPipe(dist_worker.model(), devices=["cpu"])
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    dist_worker.train(engine, opt, dist_worker.batches(), rank=0, world=1)
    single = engine.state_dict()
    for name in rank0:
        torch.testing.assert_close(rank0[name], single[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")
@pytest.mark.parametrize("gpu_workers", [1, 2])
def test_nccl_ranks_equal_one_process_on_the_whole_batch(tmp_path, gpu_workers):
    """NCCL on the GPUs at hand (one rank per GPU; on a one-GPU machine a world of one still runs
    every collective: plan broadcast, fingerprint, per-job averaging, inf flags)."""
    nproc = torch.cuda.device_count()
    result = torchrun(tmp_path, "--backend", "nccl", "--gpu-workers", str(gpu_workers), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(nproc)]
    engine = RoundPipe(dist_worker.model(), devices=["cuda:0"] * gpu_workers)
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    dist_worker.train(engine, opt, dist_worker.batches(), rank=0, world=1)
    single = engine.state_dict()
    for weights in ranks:
        for name in single:
            torch.testing.assert_close(weights[name], single[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_dead_rank_stops_the_others_with_an_error(tmp_path):
    start = time.monotonic()
    result = torchrun(tmp_path, "--die-at", "1")
    assert result.returncode != 0
    assert time.monotonic() - start < 120, "the surviving rank hung"
    assert "rank 1 dies on purpose" in result.stdout + result.stderr
    assert not (tmp_path / "rank0.pt").exists()


def test_a_ranks_line_reaches_stderr_in_one_write(monkeypatch):
    """Two ranks print their errors at once: a line written as text, then its newline (as print() does), let
    the two share a line of the output (a flaky test_cli_dist test showed it)."""
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    say("rptrain: error: rank 1: the batch does not split")
    assert writes == ["rptrain: error: rank 1: the batch does not split\n"]

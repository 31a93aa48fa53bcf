"""Several processes through the CLI, launched as users launch them: `torchrun --standalone
--nproc-per-node 2 -m rptrain.cli.main ...` (gloo on the CPU), and recipes/slurm_multinode.sh.

A tiny Llama on synthetic tokens, fp32, one microbatch: no BatchNorm (whose statistics stay per
rank) and no augmentation (seeded per rank), so two ranks on the halves of each global batch
must train exactly like one process on the whole batch, up to fp32 summation order.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from test_cli_helpers import ROOT, TEST_ENV, explain, read_jsonl, rptrain_here, train_losses

from rptrain.train import schema
from rptrain.train.checkpoint import load_checkpoint
from rptrain.train.dist import PeerError, peer_errors
from rptrain.train.errors import CheckpointError, ConfigError
from rptrain.train.resume import check_resume_state, loader_state_for
from rptrain.train.validate import validate_config

# 64 sequences, global batch 8: 8 steps per epoch. Runs stop at K and go on to N.
LM = [
    "model=llama_tiny", "model.dim=32", "data=synthetic_tokens", "data.num_train=64", "data.num_val=16",
    "data.seq_len=32", "data.vocab_size=64", "trainer.batch_size=8", "trainer.log_interval=1", "precision=fp32",
    "run_config.num_microbatch=1", "trainer.progress=false",
]
K, N = 3, 6
TWO = ["dist.timeout_s=60"]  # the two-rank run's own setting: a rank waiting on a peer that never comes fails within a minute


def torchrun(args: list[str], cwd: Path, nproc: int = 2, env: dict | None = None, timeout: float = 180,
             target: tuple[str, ...] = ("-m", "rptrain.cli.main")) -> subprocess.CompletedProcess:
    """`target`: what each rank runs (the CLI, or tests/faulty_rank.py with its fault)."""
    scratch = cwd / "scratch"  # TMPDIR: where the other ranks keep Hydra's run directory, removed on exit
    scratch.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**TEST_ENV, "TMPDIR": str(scratch), **(env or {})})


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "checkpoints" / "last.pt")["model"]


def assert_same_training(a: Path, b: Path, steps: int) -> None:
    la, lb = train_losses(read_jsonl(a / "metrics.jsonl")), train_losses(read_jsonl(b / "metrics.jsonl"))
    assert sorted(la) == sorted(lb) == list(range(1, steps + 1))
    for step in la:
        assert lb[step] == pytest.approx(la[step], abs=1e-5), step
    wa, wb = weights(a), weights(b)
    # Two ranks sum the gradients in another order; Adam divides by sqrt(v), which turns those
    # rounding differences into up to ~5e-6 on weights whose gradients are tiny (seen with some
    # seeds' initial weights). A real mistake (a missed average, a wrong batch) moves them by ~lr.
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-5, atol=2e-5, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process to K and to N (a sweep, checkpointing at K so both synchronize there), and two ranks to K."""
    tmp = tmp_path_factory.mktemp("dist")
    sweep = tmp / "one"
    proc = rptrain_here(["-m", *LM, f"trainer.max_steps={K},{N}", f"trainer.checkpoint_interval={K}", f"hydra.sweep.dir={sweep}"], cwd=tmp)
    assert proc.returncode == 0, explain(proc)
    two = torchrun([*LM, f"trainer.max_steps={K}", f"trainer.checkpoint_interval={K}", f"output_root={tmp / 'out'}", *TWO], cwd=tmp)
    return tmp, sweep / "0", sweep / "1", two


@pytest.mark.slow
def test_two_ranks_train_like_one_process_on_the_global_batch(runs):
    tmp, one_k, _, two = runs
    assert two.returncode == 0, explain(two)
    [run] = [p.parent for p in (tmp / "out").glob("**/.hydra")]  # one run directory, rank 0's
    for name in ("metrics.jsonl", "metrics.csv", "curves.png", "summary.json", "checkpoints/last.pt", "rptrain.log"):
        assert (run / name).is_file(), name
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    assert not list((tmp / "scratch").glob("rptrain-*"))  # the other rank's scratch directory is gone
    assert two.stdout.count("done: ") == 1 and "global batch 8 = 2 ranks x 4" in two.stdout
    # The ranks compared their weights before the checkpoint, and they matched.
    assert f"step {K}: the 2 ranks hold identical weights" in (run / "rptrain.log").read_text()
    assert_same_training(one_k, run, K)  # logged losses are averaged over the ranks
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == K
    assert summary["final"]["test_loss"] == pytest.approx(json.loads((one_k / "summary.json").read_text())["final"]["test_loss"], abs=1e-5)


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_one_rank(runs):
    """Stopped at K on two ranks, resumed on one to N: the same run as one process straight to N."""
    tmp, _, one_n, two = runs
    assert two.returncode == 0, explain(two)
    [run] = [p.parent for p in (tmp / "out").glob("**/.hydra")]
    resumed = tmp / "resumed"
    proc = rptrain_here([*LM, f"trainer.max_steps={N}", f"trainer.checkpoint_interval={K}", f"trainer.resume={run}",
                         f"hydra.run.dir={resumed}"], cwd=tmp)
    assert proc.returncode == 0, explain(proc)
    assert f"at step {K}" in proc.stdout
    assert_same_training(one_n, resumed, N)


@pytest.mark.slow
def test_resuming_a_completed_two_rank_run_ends_every_rank_at_once(runs):
    """rank 0 finds the run complete before the group forms: it still tells the other ranks, which exit 0 with
    it (they used to wait dist.timeout_s to join, then fail the launch)."""
    tmp, _, _, two = runs
    assert two.returncode == 0, explain(two)
    start = time.monotonic()
    again = torchrun([*LM, f"trainer.max_steps={K}", f"trainer.checkpoint_interval={K}", f"output_root={tmp / 'out'}", *TWO,
                      "trainer.resume=auto"], cwd=tmp, timeout=150)
    assert again.returncode == 0, explain(again)
    assert time.monotonic() - start < 45
    assert again.stdout.count("already completed this run") == 1 and "Traceback" not in again.stderr


def _peer_error_lines(stderr: str, rank: int) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"rptrain: error: rank {rank}: a peer rank failed or timed out")]


def faulty(mode: str, step: int) -> tuple[str, ...]:
    """The last rank dies or hangs just before `step` (tests/faulty_rank.py)."""
    return (str(ROOT / "tests" / "faulty_rank.py"), mode, str(step))


@pytest.mark.slow
def test_a_dead_rank_ends_the_run_with_one_clear_line(tmp_path):
    start = time.monotonic()
    proc = torchrun([*LM, "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120, target=faulty("die", 3))
    assert proc.returncode != 0
    assert time.monotonic() - start < 90, "the surviving rank hung"
    [line] = _peer_error_lines(proc.stderr, 0)
    assert "during gradient averaging" in line and line.endswith("see the other ranks' output"), line
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "failed" and "peer rank failed" in status["error"]


@pytest.mark.slow
def test_a_hung_rank_times_out_after_dist_timeout_s(tmp_path):
    """No launcher help: the hung rank stays alive, so only the process group's timeout can end the wait."""
    start = time.monotonic()
    proc = torchrun([*LM, "trainer.max_steps=6", "dist.timeout_s=3", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                    timeout=120, target=faulty("hang", 3))
    assert proc.returncode != 0
    assert time.monotonic() - start < 90
    [line] = _peer_error_lines(proc.stderr, 0)
    assert "timed out" in line.lower() or "timeout" in line.lower(), line


@pytest.mark.slow
def test_a_global_batch_that_does_not_split_over_the_ranks_is_one_line_and_exit_2(tmp_path):
    proc = torchrun([*LM, "trainer.batch_size=7", f"output_root={tmp_path / 'out'}"], tmp_path, timeout=120)
    assert proc.returncode != 0  # torchrun's own: 1 whenever a rank fails; the rank's is in its report
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr[-2000:]
    # Every rank finds the same mistake; torchrun stops the others at the first exit, so which rank's line
    # gets out first is a race (under load rank 0 was killed before it printed).
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rptrain:")]
    expected = ("trainer.batch_size=7 (the global batch) does not split evenly over 2 ranks "
                "(WORLD_SIZE=2): use a multiple of 2, or another number of processes")
    assert errors and all(re.fullmatch(rf"rptrain: error: rank [01]: {re.escape(expected)}", e) for e in errors), proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def _steps_logged(run_root: Path) -> int:
    files = list(run_root.glob("outputs/*/*/metrics.jsonl"))
    return sum('"kind": "train"' in line for line in files[0].read_text().splitlines()) if files else 0


@pytest.mark.slow
def test_slurm_multinode_recipe_as_plain_bash_stops_on_sigterm_and_resumes_on_one_rank(tmp_path):
    """recipes/slurm_multinode.sh without SLURM: torchrun --standalone with 2 CPU processes. SIGTERM to
    the batch shell reaches every rank through torchrun; rank 0 checkpoints, the recipe exits 143; run
    again (a requeue) with one process per node, it resumes from that checkpoint in the same run directory (trainer.resume=auto)."""
    recipe = ["bash", str(ROOT / "recipes" / "slurm_multinode.sh"), "model.dim=32", "data.seq_len=32", "data.vocab_size=64",
              "data.num_train=4096", "data.num_val=16", "trainer.max_steps=120", "trainer.log_interval=1", "trainer.progress=false"]
    (tmp_path / "scratch").mkdir()
    env = {**TEST_ENV, "TORCHRUN": f"{sys.executable} -m torch.distributed.run", "TMPDIR": str(tmp_path / "scratch")}
    proc = subprocess.Popen(recipe, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _steps_logged(tmp_path) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, (out[-3000:], err[-3000:])
    [message] = [line for line in err.splitlines() if "interrupted at step" in line]  # said once, by rank 0
    stopped_at = int(message.split("interrupted at step ")[1].split()[0])
    [run] = [p.parent for p in tmp_path.glob("outputs/*/*/.hydra")]
    assert json.loads((run / "status.json").read_text())["step"] == stopped_at
    assert max(train_losses(read_jsonl(run / "metrics.jsonl"))) == stopped_at

    again = subprocess.run(recipe, cwd=tmp_path, env={**env, "NPROC_PER_NODE": "1"}, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, explain(again)
    assert [p.parent for p in tmp_path.glob("outputs/*/*/.hydra")] == [run]  # continued in its own directory
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str((run / "checkpoints" / f"step-{stopped_at:08d}.pt").absolute())
    assert summary["steps"] == 120 and summary["world_size"] == 1
    assert sorted(train_losses(read_jsonl(run / "metrics.jsonl"))) == list(range(1, 121))


# ----------------------------------------------------------------------------- in-process pieces
@pytest.fixture
def compose_lm():
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        yield lambda *o: compose("config", overrides=[*LM, *o])


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["trainer.batch_size=7"], "does not split evenly over 2 ranks"),
    (4, ["trainer.batch_size=8", "run_config.num_microbatch=4"], "gives 2 samples per rank, fewer than run_config.num_microbatch=4"),
    (2, ["dist.timeout_s=0"], "dist.timeout_s=0"),
    (2, ["dist.backend=nccl"], "dist.backend=nccl needs CUDA"),
])
def test_dist_settings_are_checked_against_the_world_size(compose_lm, monkeypatch, world, overrides, message):
    if "nccl" in message and torch.cuda.is_available():
        pytest.skip("a CUDA machine may use nccl")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = compose_lm(*overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg)
    monkeypatch.setenv("WORLD_SIZE", "8")
    validate_config(compose_lm())  # 8 over 8 ranks: one sample each, one microbatch


def test_dist_yaml_shows_every_key_of_its_schema():
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "dist" / "default.yaml"))
    assert set(raw) == {f.name for f in schema.DistConfig.__dataclass_fields__.values()}


def test_a_loader_position_moves_between_world_sizes_that_divide_the_global_batch(tmp_path):
    two_ranks = {"seed": 0, "epoch": 1, "batch": 3, "batch_size": 4, "world_size": 2, "num_samples": 64}
    assert loader_state_for(two_ranks, 8, 1) == {**two_ranks, "batch_size": 8, "world_size": 1}
    assert loader_state_for(two_ranks, 2, 4) == {**two_ranks, "batch_size": 2, "world_size": 4}
    assert loader_state_for(two_ranks, 4, 1) == two_ranks  # another global batch: the loader refuses it
    cfg = OmegaConf.create({"trainer": {"batch_size": 8}})
    check_resume_state(tmp_path, {"loader": two_ranks}, cfg)
    with pytest.raises(CheckpointError, match="trainer.batch_size=8 but this run has trainer.batch_size=16"):
        check_resume_state(tmp_path, {"loader": two_ranks}, OmegaConf.create({"trainer": {"batch_size": 16}}))


def test_failed_collectives_become_one_line_naming_what_was_exchanged():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:1411. "
                        "This is typically caused by a remote worker crashing.\nmore")
    with pytest.raises(PeerError) as caught, peer_errors("gradient averaging"):
        raise gloo
    assert str(caught.value) == ("a peer rank failed or timed out during gradient averaging "
                                 "(Connection closed by peer [10.0.0.2]:1411): see the other ranks' output")
    with pytest.raises(ValueError), peer_errors("gradient averaging"):  # not a collective's failure: left alone
        raise ValueError("shape mismatch")

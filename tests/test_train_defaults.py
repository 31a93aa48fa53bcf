"""Defaults a first fine-tune succeeds with: data=chat's own trainer/optim defaults (the command line still
wins), evaluations (and samples) only where trainer.eval_interval puts them, and warnings for a warmup the
run never finishes and for a training set smaller than one batch."""
from __future__ import annotations

import pytest

from test_cli_helpers import TINY, explain, read_jsonl, rptrain_here
from test_train_data import make  # noqa: F401  (a fixture: composes a config)


def test_chat_data_brings_fine_tuning_defaults(make):
    chat = make("model=llama_tiny", "data=chat", "data.path=x.jsonl")
    assert (chat.trainer.batch_size, chat.trainer.epochs, chat.optim.schedule.warmup_steps) == (8, 3, 0)
    mine = make("model=llama_tiny", "data=chat", "data.path=x.jsonl", "trainer.batch_size=2", "optim=adamw", "optim.schedule.warmup_steps=7")
    assert (mine.trainer.batch_size, mine.optim.schedule.warmup_steps) == (2, 7)
    assert make("optim=adamw").optim.schedule.warmup_steps == 100 and make().trainer.batch_size == 128  # the tutorial's, unchanged


def test_eval_interval_is_honoured_and_a_short_warmup_is_warned_about(tmp_path):
    """4 steps an epoch, 2 epochs, eval_interval=3: evaluations at steps 3, 6 and the last (8), not at step 4."""
    run = tmp_path / "run"
    proc = rptrain_here([*TINY, "trainer.epochs=2", "trainer.eval_interval=3", "optim=adamw", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"] == [3, 6, 8]
    assert ">>> optim.schedule.warmup_steps=100 is more than the run's 8 steps: the learning rate never reaches optim.optimizer.lr=0.001 " \
           "(it ends at 8% of it)" in proc.stdout


def test_a_training_set_smaller_than_one_batch_is_warned_about(tmp_path):
    """Trained as the tutorial's DataLoader (drop_last=False) would, on batches of the 3 samples, but said once."""
    args = [a for a in TINY if not a.startswith("data.num_train=")] + ["data.num_train=3", "trainer.max_steps=2"]
    proc = rptrain_here([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count(">>> the training data has 3 samples, fewer than trainer.batch_size=16: every step trains on "
                             "those 3; lower trainer.batch_size or add data") == 1


@pytest.mark.parametrize("cores, cpus, load, free", [(2, 2, 0.1, 2), (2, 2, 1.0, 1), (2, 2, 6.9, 1), (8, 64, 32.0, 4), (16, 16, 3.4, 13)])
def test_threads_follow_the_cores_free_to_the_process(monkeypatch, cores, cpus, load, free):
    """The affinity's cores less the load average's share of them (at least one), unless OMP_NUM_THREADS
    or engine.threads says otherwise; the choice is printed."""
    import os

    import torch

    from rptrain.train import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert threads.choose_threads(None)[0] == free
    assert threads.choose_threads(3) == (3, "engine.threads")
    before = torch.get_num_threads()
    try:
        line = threads.set_threads(None, None, cuda=True)
        assert torch.get_num_threads() == free
        assert line.startswith(f"CPU threads: {free} intra-op ({cores} cores allowed, load {load * cores / cpus:.1f}")
        assert line.endswith(f"optimizer step {max(1, free - 1)} threads")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun, two processes on this machine: half each
        assert threads.choose_threads(None)[0] == max(1, free // 2)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert threads.choose_threads(None)[1] == "OMP_NUM_THREADS"
    finally:
        torch.set_num_threads(before)

"""Language models from the CLI: a tiny Llama learns a text written by the test; the same outputs,
checkpoints and resume as the image runs."""
from __future__ import annotations

import collections
import json
import math
import random

import pytest
from test_cli_helpers import explain, read_jsonl, rptrain_here, train_losses


def write_corpus(path, lines: int = 400, seed: int = 0) -> float:
    """Sentences over a 17-word vocabulary; returns the byte unigram entropy (nats) of the file."""
    rng = random.Random(seed)
    words = "the quick brown fox jumps over the lazy dog and then runs away into the forest where it sleeps".split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines)))
    data = path.read_bytes()
    counts = collections.Counter(data)
    return -sum(c / len(data) * math.log(c / len(data)) for c in counts.values())


@pytest.mark.slow
def test_tiny_llama_learns_a_text_below_its_unigram_entropy(tmp_path):
    corpus = tmp_path / "corpus.txt"
    entropy = write_corpus(corpus)
    run = tmp_path / "run"
    proc = rptrain_here(
        ["model=llama_tiny", "data=text", f"data.path={corpus}", "data.seq_len=64", "trainer.batch_size=16",
         "trainer.max_steps=60", "trainer.log_interval=10", "precision=bf16", "optim.optimizer.lr=3e-3",
         f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    final = summary["final"]
    # A model that only learned byte frequencies would sit at the unigram entropy (~2.95 nats).
    assert final["test_loss"] < 0.75 * entropy, (final, entropy)
    assert final["test_ppl"] == pytest.approx(math.exp(final["test_loss"]), rel=1e-6)
    assert summary["tokens_per_s"] > 0
    records = read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["tokens_per_s"] > 0 and r["ppl"] > 1 and "acc" not in r for r in train)
    assert "Train PPL" in proc.stdout and (run / "curves.png").is_file() and (run / "checkpoints" / "last.pt").is_file()


def test_language_model_resume_is_exact(tmp_path):
    base = ["model=llama_tiny", "data=synthetic_tokens", "data.num_train=64", "data.num_val=16", "data.seq_len=32",
            "data.vocab_size=64", "trainer.batch_size=8", "trainer.log_interval=1", "precision=fp32",
            "trainer.checkpoint_interval=3"]
    sweep = tmp_path / "sweep"
    proc = rptrain_here(["-m", *base, "trainer.max_steps=3,6", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    resumed = tmp_path / "resumed"
    proc = rptrain_here([*base, "trainer.max_steps=6", f"trainer.resume={sweep / '0'}", f"hydra.run.dir={resumed}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    straight = train_losses(read_jsonl(sweep / "1" / "metrics.jsonl"))
    again = train_losses(read_jsonl(resumed / "metrics.jsonl"))
    assert sorted(again) == list(range(1, 7))
    for step in range(1, 7):
        assert again[step] == pytest.approx(straight[step], abs=1e-6, rel=0), step
    assert json.loads((resumed / "summary.json").read_text())["model"] == "llama_tiny"

"""`rptrain --explain`: the engine's plan and actions for one batch of a config, without training."""
from __future__ import annotations

import re
import sys

from test_cli_faults import run_main

# A tiny Llama (4 layers: embedding, 2 blocks, head) cut into stages [0, 1) [1, 3) [3, 4).
LM = ["model=llama_tiny", "model.dim=32", "data=synthetic_tokens", "data.seq_len=32", "data.vocab_size=64",
      "trainer.batch_size=8", "run_config.num_microbatch=2", "run_config.execute_plan.forward=[1,3]"]


def test_explain_prints_the_stages_and_trains_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    run = tmp_path / "run"
    code, out, err = run_main(["--explain", *LM, f"hydra.run.dir={run}"], capsys)
    assert code == 0 and err == "", (code, err)
    assert "model llama_tiny: 4 layers" in out and "((int64[8, 32], int64[8, 32]),)" in out  # the batch it explains
    # every stage, as RoundPipe.explain names them (first-last layer), then the actions of both microbatches
    stages = [("forward", "0-0"), ("forward", "1-2"), ("fused", "3-3"), ("backward", "1-2"), ("backward", "0-0")]
    assert [(m[1], m[2]) for m in re.finditer(r"s\d (\w+) +layers (\d+-\d+) ", out)] == stages, out
    assert "d0 F s0 m1" in out and "d0 L s2 m0" in out
    assert not run.exists() and not (tmp_path / "outputs").exists()  # no run directory, so no checkpoint


def test_explain_refuses_a_sweep_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    code, out, err = run_main(["--explain", "-m", *LM], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "rptrain: error: --explain takes one run's overrides: leave out -m, --cfg, --help, --info and --shell-completion"]


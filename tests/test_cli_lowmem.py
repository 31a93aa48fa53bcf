"""optim=adamw_lowmem through the CLI (issue 29): the fit check's printout, and checkpoint/resume exactness
with a bf16 master and 8-bit moments (the step eager here: optim.compile_step=false, same formulas)."""
from __future__ import annotations

import pytest
from test_cli_helpers import explain, read_jsonl, rptrain_here, train_losses

BASE = ["model=llama_tiny", "data=synthetic_tokens", "data.num_train=64", "data.num_val=16", "data.seq_len=32",
        "data.vocab_size=64", "trainer.batch_size=8", "trainer.log_interval=1", "precision=fp32",
        "trainer.checkpoint_interval=3", "optim=adamw_lowmem", "optim.compile_step=false", "optim.schedule.warmup_steps=2",
        "optim.schedule.decay=constant"]  # a cosine decay to the last step would differ between the 3- and 6-step runs


@pytest.mark.slow  # three CLI runs per case, ~30 s on one core
@pytest.mark.parametrize("master, state, extra", [("bf16", "int8", []), ("bf16", "bf16", []), ("fp32", "int8", []),
                                                  ("bf16", "int8", ["precision=bf16", "engine.single_version=true"])],
                         ids=["bf16-int8", "bf16-bf16", "fp32-int8", "bf16-int8-single-version"])
def test_lowmem_resume_is_exact(tmp_path, master, state, extra):
    """Stopped at step 3 and resumed to 6 vs straight to 6: the same losses to 1e-6. The last case keeps one
    version of the weights (the bf16 master is the compute copy, synchronous steps: engine/host.py)."""
    base = [*BASE, f"optim.master_dtype={master}", f"optim.state_dtype={state}", *extra]
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

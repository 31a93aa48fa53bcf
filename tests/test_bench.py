"""The benchmarks run at CI size and print one valid JSON object per line (speed is not checked here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


def run_tiny(script: str, *flags: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, script, "--device", "cpu", "--tiny", *flags], cwd=BENCH, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) and "bench" in r for r in records)
    return records


@pytest.mark.parametrize("script", ["limits.py", "resnet.py", "optimizer.py", "llm.py", "data.py", "lora.py"])
def test_bench_runs_tiny_and_prints_json_lines(script):
    run_tiny(script)


def test_resnet_diagnostics():
    """Alternated rounds, the engine without its optimizer, the issuing thread's profile."""
    records = run_tiny("resnet.py", "--repeat", "2", "--no-step", "--cprofile", "--optimizer-threads", "1", "2")
    runs = [r for r in records if r["bench"] == "resnet34" and "impl" in r]
    assert [r["impl"] for r in runs] == ["plain", "rptrain", "rptrain"] * 2
    assert all(r["adam"] is False and r["rptrain_over_plain"] > 0 for r in runs if r["impl"] == "rptrain")
    assert any(r["bench"] == "resnet34_main_thread" and r["calls_per_step"] > 0 for r in records)


def test_llm_in_child_processes():
    """--isolate measures each implementation in its own process and passes its record on."""
    records = run_tiny("llm.py", "--isolate")
    (run,) = [r for r in records if r.get("impl") == "rptrain"]
    assert run["tokens_per_s"] > 0 and run["steady_tokens_per_s"] > 0 and "error" not in run


def test_llm_runs_qwen3_shapes():
    """--model qwen3_8b: the Qwen3 layer structure (q/k norms, head_dim apart from hidden_size), shrunk at CI size."""
    records = run_tiny("llm.py", "--model", "qwen3_8b")
    (run,) = [r for r in records if r.get("impl") == "rptrain"]
    assert run["model"] == "qwen3_8b" and run["tokens_per_s"] > 0 and run["mfu"] >= 0 and "error" not in run


def test_cli_resnet_ratios():
    """Issue 22's comparison at CI size: the CLI's second epoch, the engine and plain PyTorch in
    its layouts (one resnet.py process each here; one per layout on CUDA), then both ratios."""
    records = run_tiny("cli_resnet.py", "--no-compile")
    (cli,) = [r for r in records if r.get("impl") == "cli"]
    assert cli["epoch"] == 2 and cli["epoch_samples_per_s"] > 0 and cli["step_ms"] > 0, cli
    runs = {(r["impl"], r["memory_format"]) for r in records if r.get("impl") in ("plain", "rptrain") and "error" not in r}
    assert runs == {("rptrain", "inputs"), ("rptrain", "contiguous"), ("plain", "contiguous"), ("plain", "channels_last"), ("plain", "inputs")}
    ratios = {r["what"]: r["ratio"] for r in records if "what" in r}
    assert set(ratios) == {"cli_over_best_plain", "engine_over_cli_step"} and all(v > 0 for v in ratios.values())


def test_deepspeed_command_line_and_configs():
    """llm.py --impl deepspeed: both settings, each in its own process, and the configs they run under.
    DeepSpeed is a benchmark requirement that CI does not install, so its runs are not part of this test
    (`llm.py --device cpu --tiny --impl deepspeed` runs them on DeepSpeed's CPU accelerator where it is)."""
    sys.path.insert(0, str(BENCH))
    import deepspeed_zero as dz
    import llm

    args = llm.parse_args(["--device", "cuda", "--impl", "rptrain", "deepspeed", "--model", "llama_8b", "qwen3_8b", "--batch", "4"])
    assert args.impl == ["rptrain", "deepspeed_zero2", "deepspeed_zero3"] and args.ds_ratio is None and args.isolate
    assert args.model == ["llama_8b", "qwen3_8b"]
    assert llm.parse_args(["--device", "cuda", "--impl", "deepspeed_zero3", "--ds-ratio", "0.3"]).ds_ratio == 0.3
    with pytest.raises(SystemExit):
        llm.parse_args(["--ds-ratio", "1.5"])
    zero2 = dz.config("deepspeed_zero2", 4)
    assert zero2["zero_optimization"]["stage"] == 2 and zero2["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero2["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
    assert zero2["bf16"]["enabled"] and zero2["train_micro_batch_size_per_gpu"] == 4
    zero3 = dz.config("deepspeed_zero3", 4, ratio=0.35)
    assert zero3["zero_optimization"]["stage"] == 3 and zero3["zero_optimization"]["offload_optimizer"]["ratio"] == 0.35
    # By hand: 4 Gi parameters need 16 GiB of bf16 weights and gradients and 64 GiB of GPU-side state;
    # with 10 GiB of activations the room left is free - 16 - 10 - max(8, free / 10) GiB.
    GiB = 2**30
    assert dz.choose_ratio(4 * GiB, 100 * GiB, 10 * GiB) == 0.0  # room 64 GiB: everything on the GPU
    assert dz.choose_ratio(4 * GiB, 60 * GiB, 10 * GiB) == 0.6  # room 26 GiB = 0.406 of the state: 0.40 on the GPU
    assert dz.choose_ratio(4 * GiB, 30 * GiB, 10 * GiB) == 1.0  # no room: all offloaded
    # hidden 10, intermediate 20, 3 layers, vocab 100, 50 tokens, loss chunks of 40: graph 2 x (160 + 100) = 520 bytes a token
    assert dz.activation_bytes(10, 20, 3, 100, 50, 40, checkpoint=True) == (2 * 10 * 3 + 520) * 50 + 12 * 100 * 40
    assert dz.activation_bytes(10, 20, 3, 100, 50, 40, checkpoint=False) == 520 * 3 * 50 + 12 * 100 * 40

"""The benchmarks run at CI size and print one valid JSON object per line (speed is not checked here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parent.parent / "bench"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
SCRIPTS = ["limits.py", "resnet.py", "optimizer.py", "llm.py", "data.py", "lora.py", "graph_frozen.py", "host_step.py", "main_job.py",
           "optim_lowp.py", "optim_quality.py", "moe_experts.py", "checkpoint_io.py", "resident_copies.py", "cli_timeline.py",
           "checkpoint_gil.py"]
# Every CI-size invocation below, run one after another in an interpreter (runpy, as `python SCRIPT` runs it):
# each starts as a script, while torch and rptrain are imported once per interpreter instead of once per script.
RUNS = {**{script: [script] for script in SCRIPTS}, "resnet_diagnostics": ["resnet.py", "--repeat", "2", "--no-step", "--cprofile",
        "--optimizer-threads", "1", "2"], "llm_isolate": ["llm.py", "--isolate"],
        "lora_isolate_profile": ["lora.py", "--isolate", "--profile", "--impl", "rptrain"], "llm_qwen3": ["llm.py", "--model", "qwen3_8b"],
        "attention_dists": ["attention.py", "--dist", "uniform", "one"],
        "cli_resnet": ["cli_resnet.py", "--no-compile"], "main_job.py": ["main_job.py", "--stacks", "0.05"],
        "llm_moe_lowmem": ["llm.py", "--model", "qwen3_30b_a3b", "gpt_oss_20b", "--master-dtype", "bf16", "--state-dtype", "int8"],
        "lora_moe_peft": ["lora.py", "--model", "qwen3_30b_a3b", "--impl", "rptrain", "peft"]}
RUN_ALL = """
import json, runpy, sys, traceback
for name, (script, *flags) in json.loads(sys.argv[1]).items():
    print("@@@ start " + name, flush=True)
    print("@@@ start " + name, file=sys.stderr, flush=True)
    sys.argv = [script, "--device", "cpu", "--tiny", *flags]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    print(f"@@@ exit {code}", flush=True)
"""


def _sections(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("@@@ start "):
            lines = found.setdefault(line.removeprefix("@@@ start "), [])
        elif found:
            lines.append(line)
    return found


def _interpreters() -> int:
    """RUN_ALL interpreters at once: the invocations run on one core each (OMP_NUM_THREADS=1), so on CI's two
    cores two take about half the time one does (fresh clone, C++ build beside them: 91 s in one, 63 s in two)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2, cores))


# Seconds each of the longer invocations took on one core of the CI machine (2026-12-07, one interpreter, in
# RUNS order); the rest took under 2.5 s. They are dealt out longest first, each to the least loaded
# interpreter, so the interpreters end together (round-robin left one with 56 s and the other 31 s).
SECONDS = {"cli_resnet": 23.4, "cli_timeline.py": 7.9, "optim_lowp.py": 7.0, "checkpoint_io.py": 6.4, "main_job.py": 5.8,
           "lora_isolate_profile": 4.7, "llm_isolate": 4.2, "lora.py": 3.8, "host_step.py": 2.9}


def _shares(count: int) -> list[dict]:
    owner, loads = {}, [0.0] * count
    for name in sorted(RUNS, key=lambda n: -SECONDS.get(n, 1.0)):
        owner[name] = loads.index(min(loads))
        loads[owner[name]] += SECONDS.get(name, 1.0)
    return [{name: RUNS[name] for name in RUNS if owner[name] == i} for i in range(count)]  # each in RUNS order


@pytest.fixture(scope="module")
def tiny_runs() -> dict[str, tuple[int, list[str], str]]:
    """name -> (exit code, stdout lines, stderr) of every RUNS invocation (RUNS dealt out by SECONDS to the interpreters)."""
    count = _interpreters()
    shares = _shares(count)
    with ThreadPoolExecutor(count) as pool:
        outs = list(pool.map(lambda share: subprocess.run([sys.executable, "-c", RUN_ALL, json.dumps(share)], cwd=BENCH,
                                                          capture_output=True, text=True, timeout=900, env=ENV), shares))
    runs = {}
    for out in outs:
        stdout, stderr = _sections(out.stdout), _sections(out.stderr)
        for name, lines in stdout.items():
            code = int(lines[-1].removeprefix("@@@ exit ")) if lines and lines[-1].startswith("@@@ exit ") else None
            runs[name] = (code, lines[:-1] if code is not None else lines, "\n".join(stderr.get(name, [])))
    return runs


def records_of(tiny_runs, name: str) -> list[dict]:
    """The JSON records of one invocation, which must have ended with exit 0 and printed nothing else on stdout."""
    assert name in tiny_runs, f"{name} did not start (an earlier invocation ended the interpreter)"
    code, lines, stderr = tiny_runs[name]
    assert code == 0, stderr[-3000:]
    records = [json.loads(line) for line in lines if line.strip()]
    assert records and all(isinstance(r, dict) and "bench" in r for r in records)
    return records


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_runs_tiny_and_prints_json_lines(tiny_runs, script):
    records_of(tiny_runs, script)


def test_main_job_samples_its_setup_stacks(tiny_runs):
    """main_job.py --stacks: the command's threads sampled, the busiest places counted, rptrain's frames among them."""
    [record] = [r for r in records_of(tiny_runs, "main_job.py") if r["bench"] == "main_job"]
    hot = record["hot_frames"]
    assert hot and all(n > 0 and " <- " in where for n, where in hot) and any(".py:" in where.split(" <- ")[1] for _, where in hot), hot


@pytest.mark.slow
def test_resnet_diagnostics(tiny_runs):
    """Alternated rounds, the engine without its optimizer, the issuing thread's profile."""
    records = records_of(tiny_runs, "resnet_diagnostics")
    runs = [r for r in records if r["bench"] == "resnet34" and "impl" in r]
    assert [r["impl"] for r in runs] == ["plain", "rptrain", "rptrain"] * 2
    assert all(r["adam"] is False and r["rptrain_over_plain"] > 0 for r in runs if r["impl"] == "rptrain")
    assert any(r["bench"] == "resnet34_main_thread" and r["calls_per_step"] > 0 for r in records)


@pytest.mark.slow
def test_llm_in_child_processes(tiny_runs):
    """--isolate measures each implementation in its own process and passes its record on."""
    records = records_of(tiny_runs, "llm_isolate")
    (run,) = [r for r in records if r.get("impl") == "rptrain"]
    assert run["tokens_per_s"] > 0 and run["steady_tokens_per_s"] > 0 and "error" not in run


@pytest.mark.slow
def test_lora_in_a_child_process_keeps_its_profile_apart(tiny_runs):
    """lora.py --isolate --profile: the child's lora_kernels record is passed on as well, and the run's own record is
    the one with tokens/s (on 2026-12-07 the profile's record, printed first, was taken for it and the speed lost)."""
    records = records_of(tiny_runs, "lora_isolate_profile")
    (run,) = [r for r in records if r["bench"] == "lora" and r.get("impl") == "rptrain"]
    assert run["tokens_per_s"] > 0 and "error" not in run
    (profile,) = [r for r in records if r["bench"] == "lora_kernels"]
    assert profile["impl"] == "rptrain" and profile["top"]


def test_cli_timeline_notes_the_background_checkpoint_and_the_windows(tiny_runs):
    """cli_timeline.py's hooks see the CLI's log windows and checkpoint writes: the first epoch's end writes in the
    main thread, the second's on the background writer (the third's, the run's last, in the main thread again)."""
    records = records_of(tiny_runs, "cli_timeline.py")
    writes = [r["thread"] for r in records if r["bench"] == "cli_timeline" and r["event"] == "checkpoint_write_start"]
    assert writes == ["MainThread", "rptrain-checkpoint_0", "MainThread"], writes
    parts = {(r["name"], r["thread"]) for r in records if r.get("event") == "phase"}
    assert {("snapshot", "MainThread"), ("write_shards", "rptrain-checkpoint_0")} <= parts, parts
    assert sum(r.get("event") == "log_window_end" for r in records) >= 3
    assert {r["epoch"] for r in records if r["bench"] == "cli_timeline_window"} == {2, 3}


@pytest.mark.slow
def test_llm_runs_qwen3_shapes(tiny_runs):
    """--model qwen3_8b: the Qwen3 layer structure (q/k norms, head_dim apart from hidden_size), shrunk at CI size."""
    records = records_of(tiny_runs, "llm_qwen3")
    (run,) = [r for r in records if r.get("impl") == "rptrain"]
    assert run["model"] == "qwen3_8b" and run["tokens_per_s"] > 0 and run["mfu"] >= 0 and "error" not in run


@pytest.mark.slow
def test_llm_runs_moe_presets_with_the_low_memory_state(tiny_runs):
    """Issue 30's full fine-tuning runs: both MoE presets (shrunk, routing and experts kept) with bf16 master and int8 moments."""
    records = records_of(tiny_runs, "llm_moe_lowmem")
    runs = {r["model"]: r for r in records if r.get("impl") == "rptrain"}
    assert set(runs) == {"qwen3_30b_a3b", "gpt_oss_20b"}
    assert all(r["tokens_per_s"] > 0 and r["state_dtype"] == "int8" and "error" not in r for r in runs.values()), runs


@pytest.mark.slow
def test_lora_moe_against_peft(tiny_runs):
    """Issue 30's LoRA peer: transformers + PEFT of the same Qwen3-MoE config.json trains exactly as many adapter
    parameters as rptrain (attention and every expert); one process here (each its own on a GPU)."""
    records = records_of(tiny_runs, "lora_moe_peft")
    runs = {r["impl"]: r for r in records if "impl" in r}
    assert runs["rptrain"]["trainable_params"] == runs["peft"]["trainable_params"] > 0, runs
    assert "experts_gate_up" in runs["peft"]["targets"] and any(r.get("what") == "rptrain_over_peft" for r in records)


@pytest.mark.slow
def test_cli_resnet_ratios(tiny_runs):
    """Issues 22 and 33 at CI size: the CLI's second epoch, the engine, plain PyTorch in its layouts and
    the whole-step-graphed plain loop (eager on the CPU; one resnet.py process each here, one per layout
    on CUDA), then the ratios."""
    records = records_of(tiny_runs, "cli_resnet")
    (cli,) = [r for r in records if r.get("impl") == "cli"]
    assert cli["epoch"] == 2 and cli["epoch_samples_per_s"] > 0 and cli["wall_step_ms"] >= cli["step_ms"] > 0, cli
    assert 0 < cli["eval_share_of_epoch"] < 1, cli
    runs = {(r["impl"], r["memory_format"]) for r in records if r.get("impl") in ("plain", "rptrain", "graphed") and "error" not in r}
    assert runs == {("rptrain", "channels_last"), ("rptrain", "contiguous"), ("plain", "contiguous"), ("plain", "channels_last"), ("plain", "inputs"),
                    ("graphed", "channels_last"), ("graphed", "contiguous")}
    ratios = {r["what"]: r["ratio"] for r in records if "what" in r}
    assert set(ratios) == {"cli_over_best_plain", "engine_over_cli_step", "cli_over_graphed_plain", "tutorial_engine_over_graphed_plain"} and all(v > 0 for v in ratios.values())


def test_deepspeed_command_line_and_configs(monkeypatch):
    """llm.py --impl deepspeed: both settings, each in its own process, and the configs they run under.
    DeepSpeed is a benchmark requirement that CI does not install, so its runs are not part of this test
    (`llm.py --device cpu --tiny --impl deepspeed` runs them on DeepSpeed's CPU accelerator where it is)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import deepspeed_zero as dz
    import llm

    args = llm.parse_args(["--device", "cuda", "--impl", "rptrain", "deepspeed", "--model", "llama_8b", "qwen3_8b", "--batch", "4"])
    assert args.impl == ["rptrain", "deepspeed_zero2", "deepspeed_zero3"] and args.ds_ratio is None and args.isolate
    assert args.model == ["llama_8b", "qwen3_8b"]
    assert llm.parse_args(["--device", "cuda", "--impl", "deepspeed_zero3", "--ds-ratio", "0.3"]).ds_ratio == 0.3
    assert llm.parse_args(["--device", "cuda", "--impl", "fsdp2"]).isolate  # alone too: a killed run leaves a record
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
    # ZeRO's own accounting before the build: 4 Gi parameters, 0.6 offloaded: GPU 16 + 10 + 25.6 GiB, host 38.4 GiB
    dz.check_fits(4 * GiB, 0.6, 60 * GiB, 10 * GiB, 40 * GiB)
    with pytest.raises(dz.WouldNotFit, match="host 38.4 GiB of 30.0 available"):
        dz.check_fits(4 * GiB, 0.6, 60 * GiB, 10 * GiB, 30 * GiB)
    with pytest.raises(dz.WouldNotFit, match="GPU 51.6 GiB of 50.0 free"):
        dz.check_fits(4 * GiB, 0.6, 50 * GiB, 10 * GiB, 40 * GiB)


def test_lora_lean_build_fills_the_engines_frozen_storage(monkeypatch):
    """lora.py's build for the large shapes: the frozen weights are torch.empty (never written: fresh pages
    stay uncommitted) while the engine copies them, then `fill_frozen` writes random values through the
    model's parameters into the engine's own storage. The engine's loss after the fill equals the plain
    forward of the same Sequential (rel 1e-5): it computes with the filled weights, no earlier copy."""
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    import lora
    from rptrain import RoundPipe

    args = SimpleNamespace(device="cpu", rank=4, alpha=8.0, preset="llama_tiny", overrides={"vocab_size": 512}, targets=list(lora.DEFAULT_TARGETS))
    model = lora.lean_model(args, "llama_tiny")
    assert all(p.device.type == "cpu" for p in model.parameters())
    engine = RoundPipe(model)
    lora.fill_frozen(model, 0.02, "cpu")
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    out = engine.forward_backward(input_args=((x, y),), loss_fn=lambda out, _: out / y.numel())
    got = float(sum(out) if isinstance(out, (list, tuple)) else out)
    with torch.no_grad():
        want = float(model((x, y))) / y.numel()
    engine.close()
    assert abs(got - want) <= 1e-5 * abs(want) and abs(want - 6.2383) < 0.5, (got, want)


@pytest.mark.slow
def test_attention_paths_agree(tiny_runs):
    """Packed attention at CI size: every path that runs here gives sdpa_mask's output (fp32, rel 1e-5);
    causal over the whole row, the speed bound, does not where rows are packed."""
    records = records_of(tiny_runs, "attention_dists")
    runs = [r for r in records if r["bench"] == "attention"]
    assert {r["impl"] for r in runs} == {"sdpa_mask", "flex", "flex_prebuilt", "varlen", "causal"}
    assert all("error" not in r for r in records), [r for r in records if "error" in r]
    for r in runs:
        if "skipped" in r:
            assert r["impl"] == "varlen"  # CUDA only
        elif r["impl"] == "causal" and r["dist"] == "uniform":
            assert r["rel_err"] > 0.1 and r["ms"] > 0
        else:
            assert r["rel_err"] < 1e-5 and r["ms"] > 0
    assert all(r["mask_ms"] > 0 for r in runs if r["impl"] == "flex_prebuilt")
    layers = [r for r in records if r["bench"] == "attention_layer"]
    assert len(layers) == 4 and all(r["rel_err"] < 1e-5 and r["ms"] > 0 for r in layers)


def test_attention_cu_seqlens():
    """varlen's document starts over the flattened rows: a row's end always starts a new document."""
    import sys
    sys.path.insert(0, str(BENCH))
    from attention import cu_seqlens

    cu, longest = cu_seqlens(torch.tensor([[0, 0, 0, 1, 1], [4, 4, 4, 4, 4], [0, 1, 1, 0, 0]]))
    assert cu.tolist() == [0, 3, 5, 10, 11, 13, 15] and cu.dtype == torch.int32 and longest == 5


def test_llm_records_an_engine_that_does_not_fit(monkeypatch):
    """The engine's fit check refuses a model before allocating: llm.py records it as a result (as it does
    a GPU out of memory) with the host bytes needed and the budget, instead of dying."""
    monkeypatch.syspath_prepend(str(BENCH))
    import llm

    from rptrain.engine import fit

    monkeypatch.setattr(fit, "host_budget", lambda cap: (2**20, "a 1 MiB test budget"))
    record = llm.measure(llm.parse_args(["--device", "cpu", "--tiny"]), "llama_tiny", "rptrain")
    # two versions do not fit, so the engine tried one: its numbers are the smallest (engine/prefit.py)
    assert record["error"].startswith("does not fit: the training state does not fit with one version of the weights "
                                      "(single_version: synchronous steps): host memory needed"), record
    assert "1.00 MiB available (a 1 MiB test budget)" in record["error"] and "tokens_per_s" not in record
    assert record["host_budget_gib"] == round(2**20 / 2**30, 2) and record["host_needed_gib"] >= 0



def bench_main(monkeypatch, capsys, script: str, *flags: str) -> list[dict]:
    """A benchmark script's main() in this process (no interpreter start of its own), at CI size; its JSON lines."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = __import__(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--device", "cpu", "--tiny", *flags])
    module.main()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_endrun_samples_a_run_to_its_end(tmp_path, monkeypatch, capsys):
    """Issue 32's GPU mode at CI size (bash bench/gpu_suite.sh endrun): a random Llama folder written shard by
    shard, then `rptrain model=hf` to its end with its memory sampled per phase and its outputs sized."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")]))
    (folder,) = bench_main(monkeypatch, capsys, "hf_folder", "--out", str(tmp_path / "llama"))
    assert folder["params"] == 139_584 and (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    (run,) = bench_main(monkeypatch, capsys, "endrun", "--folder", str(tmp_path / "llama"), "--out-dir", str(tmp_path / "runs"))
    assert run["exit"] == 0 and run["status"] == "completed" and not run["timed_out"], run
    assert 0 < run["time_to_first_step_s"] <= run["last_step_s"] < run["wall_s"]
    assert run["peak_rss_gib"] >= run["setup_peak_gib"]["vmrss"] > 0
    assert set(run["written_gib"]) == {"checkpoints", "hf"} and "export_left_out" not in run
    assert not (tmp_path / "runs" / "hf-adamw_lowmem-end").exists()  # deleted after: its disk is the next run's
    (killed,) = bench_main(monkeypatch, capsys, "endrun", "--model", "llama_8b", "--until", "first_step", "--out-dir", str(tmp_path))
    assert killed["exit"] == -9 and killed["status"] == "running" and killed["time_to_first_step_s"] > 0, killed


@pytest.mark.slow
def test_fault_campaign_tiny_finds_nothing():
    """Issue 31's campaign at CI size (bench/faults.py --tiny), in its own interpreter (its trials send signals and
    kill processes): each kind's harness runs, and no trial executes code, loses a run, hangs, prints a traceback
    or ends badly. The campaign itself: bench/README.md."""
    out = subprocess.run([sys.executable, "faults.py", "--device", "cpu", "--tiny"], cwd=BENCH, capture_output=True, text=True,
                         timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    [summary] = [r for r in records if r["bench"] == "faults_summary"]
    kinds = {r["kind"]: r for r in records if r["bench"] == "faults"}
    assert set(kinds) == {"signal", "disk", "checkpoint", "hf_folder", "data_file", "template", "engine_api"}, kinds
    assert summary["trials"] >= 15 and all(summary[k] == 0 for k in ("code_executed", "runs_mixed_or_lost", "hangs", "tracebacks",
                                                                     "bad_ends", "harness_errors")), records


@pytest.mark.slow
def test_fault_campaign_rank_faults_resume_identical():
    """Two torchrun trials of the campaign (bench/fault_trials/ranks.py): a rank killed or frozen at a random
    moment ends the launch within its bound, and resuming on two ranks gives the straight two-rank run's state."""
    out = subprocess.run([sys.executable, "faults.py", "--only", "ranks", "--ranks", "2", "--seed", "3"], cwd=BENCH,
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    [summary] = [r for r in records if r["bench"] == "faults_summary"]
    assert summary["trials"] == 2 and all(summary[k] == 0 for k in ("code_executed", "runs_mixed_or_lost", "hangs", "tracebacks",
                                                                    "bad_ends", "harness_errors")), records

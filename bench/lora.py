"""LoRA fine-tuning throughput and memory: rptrain vs transformers + PEFT vs the original RoundPipe.

rptrain:   the preset's Sequential in bf16 with LoRA adapters (rptrain.models.lora) on q/k/v/o/gate/up/down
           (MoE presets qwen3_30b_a3b, gpt_oss_20b: q/k/v/o and every expert's gate_up and down);
           the frozen base is stored once on the host in bf16, the adapters get an fp32 master + AdamW on
           the CPU (async step), the planner's stages.
peft:      transformers' model of the same config.json (Llama, Qwen3, Qwen3-MoE with its default grouped-GEMM
           experts), random init, bf16 on the GPU, peft.get_peft_model with the same rank/alpha/targets
           (target_parameters for the experts), fused AdamW on the GPU over the adapters,
           gradient checkpointing per layer (--no-checkpoint: none; an out-of-memory error is a result).
roundpipe: the original library (roundpipe 0.1.1) wrapping the same Sequential with the same adapters:
           it makes optimizer copies only of parameters that require grad (optim_named_parameters).
All train on the same synthetic tokens; each implementation runs in its own process (--isolate, the
default on a GPU), so the host peak (ru_maxrss) is its own. Reported per run: tokens/s, the engine's
host bytes per kind (RoundPipe.memory_report), the process's peak resident memory, the GPU's peak.

Large shapes (qwen3_14b, qwen3_32b: Qwen's published config.json shapes, random weights) are built
without a second host copy (`lean_model`): the frozen weights are uncommitted CPU pages while the engine
copies them into its own storage, then filled with random values through the model's parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import traceback

import torch
from torch import nn

from common import emit, kernel_times, parser
from llm import BIG, host_model, model_config, note, pipeline_step, preset, release_host_memory, timed, tiny_overrides, tokens
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.models import build_model, parameter_count
from rptrain.models.hf_presets import MOE_PRESETS, PRESETS, llama_hf_config, preset_json
from rptrain.models.lora import DEFAULT_TARGETS, apply_lora, lora_config
from rptrain.optim import AdamW

def memory(args) -> dict:
    out = dict(host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))
    if args.device == "cuda":
        out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def lean_model(args, name: str) -> nn.Module:
    """The LoRA model with its frozen weights as uncommitted CPU pages (torch.empty: reading them maps the
    zero page), so that the engine's own copy is the only one in host memory. Built on the run's device
    (fast random init), the adapters and buffers moved to the host. Fill the frozen weights with
    `fill_frozen` once the engine holds them."""
    with torch.no_grad():
        model = apply_lora(build_model(args.preset, device=args.device, dtype=torch.bfloat16, **args.overrides), args.rank, args.alpha,
                           targets=args.targets)
        for module in model.modules():
            for p in module.parameters(recurse=False):
                p.data = p.data.cpu() if p.requires_grad else torch.empty(p.shape, dtype=p.dtype)
            for b in module.buffers(recurse=False):
                b.data = b.data.cpu()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return model


def fill_frozen(model: nn.Module, std: float, device: str) -> None:
    """Random frozen weights written in place through the parameters (which now view the engine's storage):
    norm weights 1, matrices N(0, std), generated on ``device`` one tensor at a time."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.copy_(torch.ones(p.shape, dtype=p.dtype, device=device) if p.dim() == 1
                        else torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0, std))


def run_rptrain(args, name: str) -> dict:
    model = lean_model(args, name)
    note(f"{name} built with adapters (frozen pages uncommitted)")
    engine = RoundPipe(model, cuda_graphs=args.cuda_graphs)
    fill_frozen(model, args.cfg.init_std, args.device)
    note("engine built, frozen weights filled")
    with OptimizerCtx():
        opt = AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-4)
    step = pipeline_step(engine, opt, tokens(args, args.cfg.vocab_size, args.device), RoundPipeRunConfig(num_microbatch=args.microbatches))
    timing = timed(step, args, finish=engine.wait_for_steps)
    profiled(args, name, "rptrain", step, finish=engine.wait_for_steps)
    report = {f"host_{k}_gib": round(v / 2**30, 3) for k, v in engine.memory_report(opt).items()}
    plan = engine.plan
    stages = dict(forward_stages=len(plan.forward), backward_stages=len(plan.backward)) if plan else {}
    # Closed after the record is printed: giving tens of GB of pinned memory back takes a while.
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return dict(timing=timing, cleanup=engine.close, trainable_params=trained, **report, **stages)


def profiled(args, name: str, impl: str, step, finish=lambda: None) -> None:
    """--profile: one more step under the profiler, its costliest kernels as their own record."""
    if args.profile:
        emit(bench="lora_kernels", model=name, impl=impl, **kernel_times(lambda _: step(), args.device, steps=1, top=20, finish=finish))


def hf_model(args):
    """transformers' model of the preset's config.json (Qwen3, Qwen3-MoE, GPT-OSS) or of a Llama preset, random
    init, built in bf16 on the run's device (a 30 B model in fp32 would not fit the GPU on the way)."""
    import transformers

    if args.preset in PRESETS:
        config = transformers.AutoConfig.for_model(**preset_json(args.preset, **args.overrides))
    else:
        config = transformers.LlamaConfig(**llama_hf_config(args.cfg))
    with torch.device(args.device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def peft_targets(args) -> dict:
    """PEFT's target_modules / target_parameters for the same adapters rptrain makes (read off a meta-device copy)."""
    adapted = lora_config(apply_lora(build_model(args.preset, device="meta", **args.overrides), args.rank, args.alpha, targets=args.targets))
    return dict(target_modules=adapted["target_modules"] or None, target_parameters=adapted["target_parameters"] or None)


def run_peft(args, name: str) -> dict:
    import peft

    model = hf_model(args)
    note(f"{name} built by transformers")
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, **peft_targets(args)))
    if args.checkpoint:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=args.device == "cuda")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # the same count as rptrain's: the same adapters
    x, y = (t.to(args.device) for t in tokens(args, args.cfg.vocab_size))
    n = y.numel()

    def step():
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    timing = timed(step, args)
    profiled(args, name, "peft", step)
    experts = getattr(model.config, "_experts_implementation", None)  # transformers' kernel for MoE experts
    del model, opt
    return dict(timing=timing, checkpoint=args.checkpoint, trainable_params=trained, **({"experts_implementation": experts} if experts else {}))


def run_roundpipe(args, name: str) -> dict:
    """The original library on the same LoRA Sequential; AdamW as its Adam with decoupled weight decay."""
    import roundpipe

    model = apply_lora(host_model(args, args.preset, torch.bfloat16), args.rank, args.alpha, targets=args.targets)
    note(f"{name} built with adapters")
    engine = roundpipe.RoundPipe(model, optim_dtype=torch.float32)
    with roundpipe.OptimizerCtx():
        trainable = list(engine.parameters())
        opt = roundpipe.optim.Adam(trainable, lr=1e-4, weight_decay=0.0, decoupled_weight_decay=True)
    run_cfg = roundpipe.RoundPipeRunConfig(**({"num_microbatch": args.microbatches} if args.microbatches else {}))
    step = pipeline_step(engine, opt, tokens(args, args.cfg.vocab_size, args.device), run_cfg)
    timing = timed(step, args, finish=engine.synchronize)
    del engine, opt
    return dict(timing=timing, optimizer_params=sum(p.numel() for p in trainable))


RUNNERS = {"rptrain": run_rptrain, "peft": run_peft, "roundpipe": run_roundpipe}
MOE_TARGETS = ["q", "k", "v", "o", "experts_gate_up", "experts_down"]


def measure(args, name: str, impl: str) -> dict:
    """Print one implementation's JSON record, or the error (out of memory, or why it cannot run) as a
    record, and return it."""
    args.preset, args.overrides = preset(name)
    if args.tiny or args.device == "cpu":
        args.preset, args.overrides = (args.preset, tiny_overrides(args.preset)) if args.preset in PRESETS else ("llama_tiny", {"vocab_size": 512})
    args.cfg = model_config(args.preset, **args.overrides)
    # MoE presets: adapters on attention and on every expert (their MLPs are all experts); else the dense projections.
    args.targets = args.target_names or (MOE_TARGETS if args.preset in MOE_PRESETS else list(DEFAULT_TARGETS))
    head = dict(bench="lora", model=name, impl=impl, params=parameter_count(args.cfg), rank=args.rank, batch=args.batch, seq=args.seq,
                targets=args.targets)
    if impl == "peft":
        head["checkpoint"] = args.checkpoint
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        result = RUNNERS[impl](args, name)
    except torch.OutOfMemoryError as err:
        record = dict(head, error=f"out of memory: {str(err).splitlines()[0][:200]}", **memory(args))
    except Exception as err:  # on the GPU (e.g. pinning 64 GB refused) or the original library anywhere: the reason is the result
        if impl != "roundpipe" and args.device != "cuda":
            raise
        traceback.print_exc()
        record = dict(head, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}", **memory(args))
    else:
        timing, cleanup = result.pop("timing"), result.pop("cleanup", lambda: None)
        record = dict(head, tokens_per_s=round(args.batch * args.seq / timing.step_s, 1), step_s=round(timing.step_s, 4),
                      steady_step_s=round(timing.steady_step_s, 4) if timing.steady_step_s else None, loss=round(timing.loss, 4),
                      **result, **memory(args))
    emit(**record)
    if "tokens_per_s" in record:
        cleanup()
        release_host_memory()
    return record


def measure_in_child(name: str, impl: str, timeout: float) -> dict:
    """measure() in a fresh process with a time limit; a child that dies (host out of memory: SIGKILL) or
    runs out of time still yields a record."""
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--model", name, "--impl", impl, "--no-isolate"]
    try:
        child = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=timeout)
        stdout, why = child.stdout, "killed by SIGKILL (host out of memory?)" if child.returncode == -9 else f"exited with {child.returncode}"
    except subprocess.TimeoutExpired as err:  # a record printed before the limit (e.g. during teardown) still counts
        stdout, why = err.stdout or "", f"ran past its {timeout:.0f} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    for other in lines:  # the child's other records (--profile's lora_kernels), as it printed them
        if other.get("bench") != "lora":
            emit(**other)
    # The run's own record: the first with its impl was --profile's (2026-12-07), which has no tokens/s.
    record = next((r for r in lines if r.get("bench") == "lora" and r.get("impl") == impl), None)
    return record or dict(bench="lora", model=name, impl=impl, error=f"the child process {why} and printed no result")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", nargs="+", default=["llama_8b"], help=f"llama_* and qwen3_* presets, {', '.join(MOE_PRESETS)}, or {', '.join(BIG)}")
    p.add_argument("--targets", dest="target_names", nargs="+", default=None,
                   help=f"LoRA targets (rptrain's short names; PEFT gets the same modules); default: {' '.join(DEFAULT_TARGETS)}, "
                        f"for MoE presets {' '.join(MOE_TARGETS)}")
    p.add_argument("--impl", nargs="+", default=["rptrain", "peft"], choices=list(RUNNERS))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True, help="gradient checkpointing for peft")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None, help="each run in its own process (default: on a GPU)")
    p.add_argument("--profile", action="store_true", help="one more step under the profiler: its costliest kernels (record lora_kernels)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per isolated run")
    args = p.parse_args()
    if args.tiny or args.device == "cpu":
        args.seq, args.batch, args.steps, args.warmup, args.rank = 32, 2, 2, 1, 4
    if args.isolate is None:
        args.isolate = args.device == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    for name in args.model:
        speeds = {}
        for impl in args.impl:
            if args.isolate:
                record = measure_in_child(name, impl, args.timeout)
                emit(**record)
            else:
                record = measure(args, name, impl)
            if "tokens_per_s" in record:
                speeds[impl] = record["tokens_per_s"]
        for other in ("peft", "roundpipe"):
            if "rptrain" in speeds and other in speeds:
                emit(bench="lora", model=name, what=f"rptrain_over_{other}", ratio=round(speeds["rptrain"] / speeds[other], 3))


if __name__ == "__main__":
    main()

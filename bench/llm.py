"""Llama-style decoder training throughput: the engine vs plain PyTorch vs FSDP2 + CPUOffloadPolicy.

rptrain: bf16 compute copy, fp32 master + AdamW on the CPU (async step), the planner's stages.
plain:   fp32 weights on the GPU, bf16 autocast, activation checkpointing per block (--no-checkpoint:
         none), fused AdamW.
plain_ao8: plain PyTorch as it fits the most on one GPU: bf16 weights and gradients on the GPU (no fp32
         master), torchao's AdamW8bit (8-bit moments, bf16 stochastic rounding: the preset optim=adamw_lowmem's
         state) and activation checkpointing per block; torchao must be installed (bench/README.md).
fsdp2:   fully_shard per block (+ root) with CPUOffloadPolicy and bf16 MixedPrecisionPolicy,
         activation checkpointing per block (or none), AdamW on the CPU (one process, world size 1).
roundpipe: the original RoundPipe library (optional, --impl roundpipe) with the same model and loss.
deepspeed: DeepSpeed ZeRO-2 with the optimizer on the CPU and ZeRO-3 with a share of it on the GPU
         (--impl deepspeed runs both, each in its own process; deepspeed_zero.py).
All train the same nn.Sequential (rptrain.models) on the same synthetic tokens; --fused builds it with
model.fused (norms, rotary, SwiGLU and the loss's softmax as torch.compile'd kernels) for every one of them.

Reported: tokens/s, model FLOPs utilisation (6N + attention, per token) and hardware FLOPs
utilisation (recomputed forwards counted) against the measured bf16 matmul peak (--peak).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import deepspeed_zero
from common import emit, high_water, meminfo, parser
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.engine import DoesNotFit, trace
from rptrain.models import LlamaConfig, build_model, count_tokens, flops_per_token, llama_config, qwen3_config
from rptrain.models.hf_presets import MOE_PRESETS, PRESETS
from rptrain.models.llama import decoder_config
from rptrain.optim import AdamW
from rptrain.optim.state import state_memory_of


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, batch):
        h, targets = batch
        return checkpoint(lambda x: self.block((x, targets))[0], h, use_reentrant=False), targets


_START = time.perf_counter()


def note(message: str) -> None:
    """Progress on stderr (the JSON lines stay on stdout): where a long run spends its time."""
    print(f"[llm +{time.perf_counter() - _START:.1f}s] {message}", file=sys.stderr, flush=True)


def tokens(args, vocab: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if device == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


# --tiny / CPU: a Qwen3 preset keeps its layer structure (q/k norms, head_dim apart from hidden_size) at toy size.
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, vocab_size=512)


# --tiny / CPU: the MoE presets keep their routing and expert layout at toy size (dimensions multiples of 16 bytes,
# so the grouped GEMM runs as it does on the GPU).
TINY_MOE = {
    "qwen3_30b_a3b": dict(TINY_QWEN3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "gpt_oss_20b": dict(TINY_QWEN3, intermediate_size=32, head_dim=16, num_experts=8, num_experts_per_tok=2),
}


def tiny_overrides(name: str) -> dict:
    """The CI-size config.json overrides of a preset with a config.json (none for the Llama ones)."""
    return TINY_MOE.get(name, TINY_QWEN3 if name in PRESETS else {})


# Qwen3-14B / Qwen3-32B config.json shapes, as overrides of the qwen3_8b preset (same vocabulary, head_dim 128).
BIG = {
    "qwen3_14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8),
    "qwen3_32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8),
}


# A preset cut to fewer layers, to compare implementations on an 80 GB card where the whole model does not fit one
# of them: NAME@N is preset NAME with N decoder layers (e.g. qwen3_30b_a3b@12 for its LoRA against PEFT on an H100).
def preset(name: str) -> tuple[str, dict]:
    """(registered preset, config overrides) of a benchmark model name."""
    if "@" in name:
        base, layers = name.split("@")
        found, overrides = preset(base)
        return found, dict(overrides, num_hidden_layers=int(layers))
    return ("qwen3_8b", dict(BIG[name])) if name in BIG else (name, {})


def model_config(name: str, **overrides):
    """A preset's config (LlamaConfig or DecoderConfig): vocab_size, max_seq_len and what flops_per_token reads."""
    return qwen3_config(name, **overrides) if name in PRESETS else llama_config(name, **overrides)


def forward_flops(cfg, seq: int) -> float:
    """One forward's FLOPs per token (a third of the training estimate)."""
    return flops_per_token(cfg, seq) / 3


def host_model(args, name: str, dtype: torch.dtype) -> nn.Module:
    """The model in host memory, as the engines and FSDP2's CPU offload take it. On a GPU machine the
    random init runs there and the weights are copied down: CPU normal_ is single-threaded (3B: ~90 s)."""
    torch.manual_seed(0)  # the same initial weights in every process: losses compare across implementations and runs
    if args.device != "cuda":
        return build_model(name, dtype=dtype, **args.overrides)
    model = build_model(name, device="cuda", dtype=dtype, **args.overrides).to("cpu")
    if getattr(model[-1], "tied", False):  # a move across devices gives each module its own copy
        model[-1].lm_head.weight = model[0].embed_tokens.weight
    torch.cuda.empty_cache()
    return model


def run_rptrain(args, cfg, name):
    # Only options away from their defaults are passed: gpu_suite.sh engine-ab runs this script against an
    # engine from before they existed.
    options = dict(cuda_graphs=args.cuda_graphs, max_gpu_memory=args.max_gpu_memory)
    if args.master_dtype != "fp32" or args.state_dtype != "fp32":  # issue 29's low-memory state (optim=adamw_lowmem: bf16, int8)
        master = torch.bfloat16 if args.master_dtype == "bf16" else torch.float32
        options.update(optim_dtype=master, optimizer=state_memory_of(AdamW, master, **low_memory_state(args)), keep_user_weights=False)
    if not args.gpu_state:
        options["gpu_state"] = False
    if args.single_version != "auto":  # the engine's single_version (one version of the weights, synchronous steps)
        options["single_version"] = args.single_version == "on"
    if args.gpu_reserve is not None or args.stream or args.host_step_gpu_share is not None or args.step_overlap is not None:
        from rptrain import Tuning
        reserve = args.gpu_reserve
        tuning = dict(gpu_state_reserve=reserve, streamed_gpu_state_reserve=reserve) if reserve is not None else {}
        if args.host_step_gpu_share is not None:  # passed only when set: an engine from before the option
            tuning["host_step_gpu_share"] = args.host_step_gpu_share
        if args.step_overlap is not None:  # passed only when set, as the share
            tuning["step_overlap"] = args.step_overlap
        if args.stream:  # stream every stage instead of keeping the model resident (three copies of it on the GPU)
            tuning.update(resident_share=0.0, resident_share_gpu_state=0.0)
        options["tuning"] = Tuning(**tuning)
    fits_first(args, name, options)
    model = host_model(args, name, torch.bfloat16)
    note(f"{name} built" + (f" with {args.overrides}" if args.overrides else ""))
    engine = RoundPipe(model, **options)
    note(str(engine.placement))
    on_gpu = getattr(engine.placement, "params_on", lambda _: 0)("gpu")  # trainable parameters whose state and step are on the GPU
    single = getattr(engine.placement, "single_version", False)
    with OptimizerCtx():
        opt = AdamW(engine.parameters(), lr=1e-4, **low_memory_state(args))
    note("engine and optimizer ready")
    microbatches = args.microbatches or (1 if args.batch == 1 else None)  # None: the engine's default
    run_cfg = RoundPipeRunConfig(num_microbatch=microbatches, recompute_grain=args.grain)
    step = pipeline_step(engine, opt, tokens(args, cfg.vocab_size, args.device), run_cfg, is_async=args.is_async)
    timing = timed(step, args, finish=engine.wait_for_steps)
    split = traced_split(step, engine.wait_for_steps, args.trace_steps) if args.trace_steps else {}
    if args.device == "cuda":
        split.update(gpu_busy(step, args.busy_steps, finish=engine.wait_for_steps))
    plan = engine.plan
    recomputed = sum(b - a for a, b in plan.backward[:-1]) if plan else 0
    layers = len(model)
    engine.close()
    stages = dict(forward_stages=len(plan.forward), backward_stages=len(plan.backward)) if plan else {}
    return timing, recomputed / max(layers - 2, 1), {**stages, **split, "gpu_state_params": on_gpu, "is_async": args.is_async,
                                                                    "single_version": single}


def fits_first(args, name: str, options: dict) -> None:
    """The engine's fit check on a meta-device copy: a model that cannot fit is a result in seconds, before a
    build of tens of GB (GPT-OSS-20B) is made and copied to the host. Engines before check_model_fits skip it."""
    import rptrain.engine

    check = getattr(rptrain.engine, "check_model_fits", None)
    if check is not None:
        keys = ("optim_dtype", "optimizer", "gpu_state", "max_gpu_memory", "tuning", "single_version")
        check(build_model(name, device="meta", dtype=torch.bfloat16, **args.overrides), **{k: options[k] for k in keys if k in options})


def low_memory_state(args) -> dict:
    """AdamW's moments in ``--state-dtype`` (only when asked: engine-ab runs an optimizer from before the option)."""
    return {"state_dtype": args.state_dtype} if args.state_dtype != "fp32" else {}


def pipeline_step(engine, opt, batch, run_cfg, is_async: bool = True):
    """One training step through a RoundPipe-style engine (ours and the original library share the API).
    ``is_async``: the step's gradients were taken at weights one step old (the tutorial's semantics);
    on a repeated batch that trains visibly slower than plain PyTorch's synchronous step."""
    x, y = batch
    n = count_tokens(y)

    def step():
        loss = engine.forward_backward(input_args=((x, y),), loss_fn=lambda out, _: out / n, run_config=run_cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        return sum(loss) if isinstance(loss, (list, tuple)) else loss  # the original returns one loss per microbatch

    return step


def traced_split(step, finish, steps: int) -> dict[str, float]:
    """Seconds per step on each side: the GPU call (main thread) and the optimizer thread's task.
    The step takes about the larger of the two when they overlap."""
    trace.clear()
    trace.enable()
    for _ in range(steps):
        step()
    finish()
    trace.enable(False)
    totals: dict[str, float] = {}
    for name, _, start, stop in trace.spans():
        totals[name] = totals.get(name, 0.0) + stop - start
    parts = ("bind_grads", "step_fn", "write_compute_copy", "upload_resident", "stage_from_master", "finish_gpu_step")
    out = dict(forward_backward_s=totals.get("forward_backward", 0.0), wait_weights_s=totals.get("wait_weights", 0.0),
               optimizer_task_s=sum(totals.get(k, 0.0) for k in parts), **{f"{k}_s": totals.get(k, 0.0) for k in parts})
    return {k: round(v / steps, 4) for k, v in out.items()}


def gpu_busy(step, steps: int, finish=lambda: None) -> dict[str, float]:
    """Share of the wall time, from the first kernel of ``steps`` consecutive steps to the last,
    in which some kernel runs on the GPU (copies not counted): "GPU busy" from a CUDA-only
    profiler trace (its kernel timestamps; the profiler adds no host-side work per op). Nothing
    when ``steps`` is 0."""
    if steps <= 0:
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    finish()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            finish()
            torch.cuda.synchronize()
        spans = sorted(
            (e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.name.lower().startswith(("memcpy", "memset"))
        )
    except Exception as e:  # a profiler that cannot trace here must not cost the measurement
        return dict(gpu_busy_error=f"{type(e).__name__}: {e}"[:200])
    if not spans:
        return {}
    busy, start, end = 0.0, spans[0][0], spans[0][0]
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return dict(gpu_busy=round(busy / max(end - start, 1e-9), 3), gpu_busy_window_s=round((end - start) / 1e6, 3), kernels=len(spans))


def run_roundpipe(args, cfg, name):
    """The original RoundPipe library (``pip install roundpipe``, CUDA only) on the same Sequential,
    tokens and loss; AdamW as its Adam with decoupled weight decay. Its recompute is not counted."""
    import roundpipe

    model = host_model(args, name, torch.bfloat16)
    note(f"{name} built" + (f" with {args.overrides}" if args.overrides else ""))
    engine = roundpipe.RoundPipe(model, optim_dtype=torch.float32)
    with roundpipe.OptimizerCtx():
        opt = roundpipe.optim.Adam(engine.parameters(), lr=1e-4, weight_decay=0.01, decoupled_weight_decay=True)
    microbatches = args.microbatches or (1 if args.batch == 1 else None)
    run_cfg = roundpipe.RoundPipeRunConfig(**({"num_microbatch": microbatches} if microbatches else {}))
    step = pipeline_step(engine, opt, tokens(args, cfg.vocab_size, args.device), run_cfg, is_async=args.is_async)
    timing = timed(step, args, finish=engine.synchronize)
    del engine, opt
    torch.cuda.empty_cache()
    return timing, 0.0, {"hfu_counts_recompute": False}


def run_plain(args, cfg, name, low_memory: bool = False):
    """fp32 weights, bf16 autocast and torch's fused AdamW; ``low_memory`` (plain_ao8): bf16 weights and
    torchao's AdamW8bit with bf16 stochastic rounding."""
    if low_memory:
        from torchao.optim import AdamW8bit  # ModuleNotFoundError: a result (measure)
    torch.manual_seed(0)  # as host_model: the same initial weights, so losses compare
    model = build_model(name, device="cuda", dtype=torch.bfloat16 if low_memory else torch.float32, **args.overrides)
    checkpoint_blocks(model, args.checkpoint)
    if low_memory:
        opt = AdamW8bit(model.parameters(), lr=1e-4, bf16_stochastic_round=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step = torch_step(model, opt, tokens(args, cfg.vocab_size, "cuda"), autocast=not low_memory)
    timing = timed(step, args)
    extra = gpu_busy(step, args.busy_steps)
    del model, opt
    torch.cuda.empty_cache()
    return timing, float(args.checkpoint), extra


def checkpoint_blocks(model: nn.Sequential, on: bool) -> None:
    if on:
        for i in range(1, len(model) - 1):
            model[i] = Checkpointed(model[i])


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, batch, autocast: bool):
    """One plain training step (plain PyTorch and FSDP2 share it)."""
    x, y = batch
    n = count_tokens(y)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model((x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True))) / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run_fsdp2(args, cfg, name):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    model = host_model(args, name, torch.float32)
    checkpoint_blocks(model, args.checkpoint)
    policy = dict(offload_policy=CPUOffloadPolicy(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for i in range(1, len(model) - 1):
        fully_shard(model[i], **policy)
    fully_shard(model, **policy)  # embedding and the (tied) head live in the root unit
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # FSDP2's MixedPrecisionPolicy already computes in bf16: no autocast.
    step = torch_step(model, opt, tokens(args, cfg.vocab_size, "cuda"), autocast=False)
    timing = timed(step, args)
    extra = gpu_busy(step, args.busy_steps)
    del model, opt
    dist.destroy_process_group()
    return timing, float(args.checkpoint), extra


def run_deepspeed(args, cfg, name, setting: str):
    """DeepSpeed's ZeRO-Offload (deepspeed_zero2) or ZeRO-3 partial offload (deepspeed_zero3) on the
    same Sequential, tokens and loss, bf16 weights built on the device."""
    free = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 0
    params = sum(p.numel() for p in build_model(name, device="meta", dtype=torch.bfloat16, **args.overrides).parameters())
    ratio, extra = None, {}
    if setting == "deepspeed_zero3":
        d = decoder_config(cfg) if isinstance(cfg, LlamaConfig) else cfg
        activations = deepspeed_zero.activation_bytes(d.hidden_size, d.intermediate_size, d.n_layers, d.vocab_size,
                                                      args.batch * args.seq, d.loss_chunk_tokens, args.checkpoint)
        chosen = deepspeed_zero.choose_ratio(params, free, activations) if free else 0.5
        ratio = chosen if args.ds_ratio is None else args.ds_ratio
        extra = dict(ds_offload_ratio=ratio, ds_ratio_chosen=chosen, gpu_free_gib=round(free / 2**30, 2),
                     activation_estimate_gib=round(activations / 2**30, 2))
        if free:
            deepspeed_zero.check_fits(params, ratio, free, activations, meminfo()["MemAvailable"])
    model = build_model(name, device=args.device, dtype=torch.bfloat16, **args.overrides)
    checkpoint_blocks(model, args.checkpoint)
    note(f"{name} built ({params:,} parameters); DeepSpeed {setting}, offload ratio {ratio}")
    ds_config = deepspeed_zero.config(setting, args.batch, ratio)
    x, y = tokens(args, cfg.vocab_size, args.device)
    step, engine = deepspeed_zero.engine_step(model, ds_config, (x, y), args.device, count_tokens(y))
    timing = timed(step, args)
    if args.device == "cuda":
        extra.update(gpu_busy(step, args.busy_steps))
    extra.update(ds_stage=deepspeed_zero.SETTINGS[setting], checkpoint=args.checkpoint)
    engine.destroy()
    del engine, step, model
    torch.cuda.empty_cache()
    return timing, float(args.checkpoint), extra


def release_host_memory() -> None:
    """Give the last run's pinned host memory back to the OS: torch caches freed pinned blocks, and
    at 3B the engine's (tens of GB) would otherwise starve the next implementation in this process."""
    gc.collect()
    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


class Timing(NamedTuple):
    step_s: float  # wall time of the timed steps, the engine's last optimizer task included, per step
    steady_step_s: float | None  # median step-to-step interval after the first: a long run's period
    loss: float


def timed(step, args, finish=lambda: None) -> Timing:
    """The engine's optimizer task for step k overlaps step k+1's GPU work, so a short run's clock
    also pays the last task once; `steady_step_s` leaves that out (the GPU is synchronized after
    every step, for every implementation alike, so each interval is a whole step)."""
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    for i in range(args.warmup):
        t0 = time.perf_counter()
        step()
        note(f"warm-up step {i + 1}: {time.perf_counter() - t0:.2f} s (host side)")
    finish()
    sync()
    stamps = [time.perf_counter()]
    loss = None
    for _ in range(args.steps):
        loss = step()
        sync()
        stamps.append(time.perf_counter())
    finish()
    sync()
    intervals = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # the first step starts with no task queued
    steady = statistics.median(intervals) if intervals else None
    return Timing((time.perf_counter() - stamps[0]) / args.steps, steady, float(loss))


IMPLS = ["rptrain", "plain", "plain_ao8", "fsdp2", "roundpipe", "deepspeed", *deepspeed_zero.SETTINGS]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--model", nargs="+", default=["llama_1b", "llama_3b"],
                   help=f"llama_* and qwen3_* presets, e.g. qwen3_8b, and the MoE ones ({', '.join(MOE_PRESETS)}: rptrain only)")
    p.add_argument("--impl", nargs="+", default=["rptrain", "plain", "fsdp2"], choices=IMPLS,
                   help="roundpipe: the original library (its wheel must be installed); deepspeed: both DeepSpeed settings "
                        "(deepspeed_zero2: ZeRO-Offload, deepspeed_zero3: ZeRO-3 partial offload; DeepSpeed must be installed)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--grain", choices=["stage", "layer"], default=None)
    p.add_argument("--steps", type=int, default=6)
    # The engine's first call measures every layer and its second may record CUDA graphs: neither is timed.
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trace-steps", type=int, default=2, help="extra engine steps traced to split GPU and optimizer time")
    p.add_argument("--busy-steps", type=int, default=0, help="extra steps under a CUDA profiler: the share of time a kernel runs")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help="the engine's cuda_graphs option")
    p.add_argument("--gpu-state", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's gpu_state option: the leading layers' optimizer state on the GPU (--no-gpu-state: all on the host)")
    p.add_argument("--async", dest="is_async", action=argparse.BooleanOptionalAction, default=True,
                   help="the engines' step(is_async=...): --no-async steps synchronously, as plain PyTorch does (same losses)")
    p.add_argument("--step-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="rptrain: Tuning.step_overlap (one version: the next call runs while the step does); --no-step-overlap waits")
    p.add_argument("--host-step-gpu-share", type=float, default=None,
                   help="rptrain: Tuning.host_step_gpu_share, the share of a one-version step's host runs the GPU steps (0: off)")
    p.add_argument("--gpu-reserve", type=float, default=None,
                   help="Tuning.gpu_state_reserve and streamed_gpu_state_reserve: the share of free GPU memory kept for activations when placing the state")
    p.add_argument("--stream", action="store_true", help="rptrain: stream the weights even where the model could stay resident "
                   "(Tuning.resident_share 0): with one version, more of the state fits on the GPU")
    p.add_argument("--max-gpu-memory", default=None, help="the engine's max_gpu_memory, e.g. 100GiB: caps the GPU state's budget")
    p.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="activation checkpointing per block for plain, fsdp2 and deepspeed")
    p.add_argument("--ds-ratio", type=float, default=None,
                   help="deepspeed_zero3: the share of the optimizer state offloaded to the CPU (default: chosen from free GPU memory)")
    p.add_argument("--master-dtype", choices=["fp32", "bf16"], default="fp32", help="rptrain: the master weights (issue 29)")
    p.add_argument("--single-version", choices=["auto", "on", "off"], default="auto",
                   help="rptrain: one version of the weights (synchronous steps); auto: the engine chooses (Tuning.one_version_host_share)")
    p.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32", help="rptrain: AdamW's moments (issue 29)")
    p.add_argument("--fused", action="store_true",
                   help="build the model with fused=True (rptrain.models.fused) for every implementation, so ratios stay like-for-like")
    p.add_argument("--peak", type=float, default=780.0, help="bf16 matmul TFLOP/s (bench/limits.py)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each implementation in its own process (default: on a GPU; a run the OS kills still leaves a record)")
    args = p.parse_args(argv)
    if args.ds_ratio is not None and not 0.0 <= args.ds_ratio <= 1.0:
        p.error(f"--ds-ratio {args.ds_ratio}: give a share between 0 and 1")
    args.impl = list(dict.fromkeys(s for i in args.impl for s in (deepspeed_zero.SETTINGS if i == "deepspeed" else [i])))
    args.overrides = {}
    if args.tiny or args.device == "cpu":
        args.model = list(dict.fromkeys(name if name in PRESETS or name in BIG else "llama_tiny" for name in args.model))
        # plain, fsdp2 and roundpipe need CUDA; DeepSpeed runs on its CPU accelerator
        args.impl = [i for i in args.impl if i == "rptrain" or i in deepspeed_zero.SETTINGS] or ["rptrain"]
        args.seq, args.batch, args.steps, args.warmup = 32, 2, 2, 1
    if args.isolate is None:  # alone too: FSDP2 at 8 B died in-process with no record (2026-12-04)
        args.isolate = args.device == "cuda"
    return args


def main() -> None:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    for name in args.model:
        records = {}
        for impl in args.impl:
            record = measure_in_child(name, impl) if args.isolate else measure(args, name, impl)
            emit(**record)
            if "tokens_per_s" in record:
                records[impl] = record
        for other in ("plain", "plain_ao8", "fsdp2", "roundpipe", *deepspeed_zero.SETTINGS):
            if "rptrain" in records and other in records:
                mine, theirs = records["rptrain"], records[other]
                ratios = dict(ratio=round(mine["tokens_per_s"] / theirs["tokens_per_s"], 3))
                if "steady_tokens_per_s" in mine and "steady_tokens_per_s" in theirs:
                    ratios["steady_ratio"] = round(mine["steady_tokens_per_s"] / theirs["steady_tokens_per_s"], 3)
                emit(bench="llm", model=name, what=f"rptrain_over_{other}", **ratios)


def measure(args, name: str, impl: str) -> dict:
    """One implementation's JSON record (or its out-of-memory error) in this process."""
    runners = {"rptrain": run_rptrain, "plain": run_plain, "plain_ao8": functools.partial(run_plain, low_memory=True), "fsdp2": run_fsdp2, "roundpipe": run_roundpipe,
               **{s: functools.partial(run_deepspeed, setting=s) for s in deepspeed_zero.SETTINGS}}
    # Rotary tables are built up to max_seq_len: longer benchmark sequences raise it.
    base, big = preset(name)  # the big Qwen3 shapes are qwen3_8b with other sizes
    shrink = tiny_overrides(base) if args.tiny or args.device == "cpu" else {}
    args.overrides = {**big, **shrink, **({"max_seq_len": args.seq} if args.seq > model_config(base).max_seq_len else {}),
                      **({"fused": True} if args.fused else {})}
    cfg = model_config(base, **args.overrides)
    tokens_per_step = args.batch * args.seq
    model_flops = flops_per_token(cfg, args.seq) * tokens_per_step
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        timing, recompute_share, extra = runners[impl](args, cfg, base)
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        release_host_memory()
        return dict(bench="llm", model=name, impl=impl, seq=args.seq, error=f"out of memory: {str(e).splitlines()[0]}")
    except DoesNotFit as e:  # the engine's check before allocating: a result, as out of memory is
        p = e.placement
        return dict(bench="llm", model=name, impl=impl, seq=args.seq, error=f"does not fit: {e}",
                    host_needed_gib=round(p.total("host") / 2**30, 2), host_budget_gib=round(p.host_budget / 2**30, 2))
    except deepspeed_zero.WouldNotFit as e:
        return dict(bench="llm", model=name, impl=impl, seq=args.seq, error=f"out of memory by ZeRO's accounting, before the build: {e}")
    except ModuleNotFoundError as e:  # deepspeed, roundpipe: benchmark requirements (bench/README.md)
        return dict(bench="llm", model=name, impl=impl, seq=args.seq, error=f"{e.name} is not installed: pip install {e.name}")
    if args.device == "cuda":  # how far the sequence could still grow on this GPU
        extra["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    extra["host_peak_gib"] = round(high_water() / 2**30, 2)  # this process's own peak, pinned buffers included
    release_host_memory()
    hardware_flops = model_flops + recompute_share * forward_flops(cfg, args.seq) * tokens_per_step
    seconds, peak = timing.step_s, args.peak * 1e12
    if impl in ("plain", "plain_ao8", "fsdp2"):
        extra["checkpoint"] = args.checkpoint
    if timing.steady_step_s:
        steady = timing.steady_step_s
        extra.update(steady_step_s=round(steady, 4), steady_tokens_per_s=round(tokens_per_step / steady, 1),
                     steady_mfu=round(model_flops / steady / peak, 3), steady_hfu=round(hardware_flops / steady / peak, 3))
    if impl == "rptrain":
        extra.update(master_dtype=args.master_dtype, state_dtype=args.state_dtype)
    return dict(bench="llm", model=name, impl=impl, seq=args.seq, batch=args.batch, fused=args.fused, step_s=round(seconds, 4),
                tokens_per_s=round(tokens_per_step / seconds, 1), loss=round(timing.loss, 4),
                mfu=round(model_flops / seconds / peak, 3), hfu=round(hardware_flops / seconds / peak, 3), **extra)


def measure_in_child(name: str, impl: str) -> dict:
    """measure() in a fresh process: nothing one implementation caches (pinned host blocks, graph
    pools, the original library's buffers) can starve the next. Same arguments, one model and impl;
    argparse keeps the last --model/--impl given."""
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--model", name, "--impl", impl, "--no-isolate"]
    child = subprocess.run(argv, stdout=subprocess.PIPE, text=True)  # stderr (progress notes) passes through
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    record = next((r for r in lines if r.get("impl") == impl), None)
    if record is None:
        return dict(bench="llm", model=name, impl=impl, seq=None, error=f"the child process exited with {child.returncode} and no result")
    return record


if __name__ == "__main__":
    main()

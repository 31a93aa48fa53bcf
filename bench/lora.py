"""LoRA fine-tuning throughput and memory: rptrain vs plain PyTorch + PEFT.

rptrain: the preset's Sequential in bf16 with LoRA adapters (rptrain.models.lora) on q/k/v/o/gate/up/down;
         the frozen base is stored once on the host in bf16, the adapters get an fp32 master + AdamW on
         the CPU (async step), the planner's stages.
peft:    transformers' LlamaForCausalLM of the same shape, bf16 on the GPU, peft.get_peft_model with the
         same rank/alpha/targets, fused AdamW on the GPU over the adapters, gradient checkpointing per
         layer (--no-checkpoint: none).
Both train on the same synthetic tokens. Reported per run: tokens/s, the engine's host bytes per kind
(RoundPipe.memory_report), the process's resident host memory and the GPU's peak allocation.
`--override dim=5120 n_layers=64 ...` changes the preset's shape (e.g. the largest that fits). The host
peak is the process's: run one --impl per invocation for each one's own. Not yet run on a GPU.
"""
from __future__ import annotations

import argparse
import resource

import torch

from common import emit, parser
from llm import host_model, note, pipeline_step, release_host_memory, timed, tokens
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.models import llama_config, parameter_count
from rptrain.models.hf_presets import llama_hf_config
from rptrain.models.lora import DEFAULT_TARGETS, apply_lora, target_modules
from rptrain.optim import AdamW


def memory(args) -> dict:
    out = dict(host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))
    if args.device == "cuda":
        out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def run_rptrain(args, name: str) -> dict:
    model = apply_lora(host_model(args, name, torch.bfloat16), args.rank, args.alpha)
    note(f"{name} built with adapters")
    engine = RoundPipe(model, cuda_graphs=args.cuda_graphs)
    with OptimizerCtx():
        opt = AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-4)
    step = pipeline_step(engine, opt, tokens(args, args.cfg.vocab_size, args.device), RoundPipeRunConfig(num_microbatch=args.microbatches))
    timing = timed(step, args, finish=engine.wait_for_steps)
    report = {f"host_{k}_gib": round(v / 2**30, 3) for k, v in engine.memory_report(opt).items()}
    engine.close()
    return dict(timing=timing, **report)


def run_peft(args, name: str) -> dict:
    import peft
    import transformers

    config = transformers.LlamaConfig(**llama_hf_config(args.cfg))
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=sorted(target_modules(DEFAULT_TARGETS))))
    if args.checkpoint:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=args.device == "cuda")
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
    del model, opt
    return dict(timing=timing)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", nargs="+", default=["llama_8b"])
    p.add_argument("--impl", nargs="+", default=["rptrain", "peft"], choices=["rptrain", "peft"])
    p.add_argument("--override", nargs="*", default=[], help="preset fields, e.g. dim=5120 n_layers=64 ffn_hidden=25600")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True, help="gradient checkpointing for peft")
    args = p.parse_args()
    args.overrides = {k: int(v) if v.isdigit() else float(v) for k, v in (o.split("=", 1) for o in args.override)}
    if args.tiny or args.device == "cpu":
        args.model, args.overrides = ["llama_tiny"], {"vocab_size": 512}
        args.seq, args.batch, args.steps, args.warmup, args.rank = 32, 2, 2, 1, 4
    torch.backends.cuda.matmul.allow_tf32 = True
    for name in args.model:
        args.cfg = llama_config(name, **args.overrides)
        speeds = {}
        for impl in args.impl:
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                result = (run_rptrain if impl == "rptrain" else run_peft)(args, name)
            except torch.OutOfMemoryError as err:
                emit(bench="lora", model=name, impl=impl, error=f"out of memory: {str(err)[:200]}")
                continue
            timing = result.pop("timing")
            speeds[impl] = args.batch * args.seq / timing.step_s
            emit(bench="lora", model=name, impl=impl, params=parameter_count(args.cfg), rank=args.rank,
                 batch=args.batch, seq=args.seq, tokens_per_s=round(speeds[impl], 1), step_s=round(timing.step_s, 4),
                 loss=round(timing.loss, 4), **result, **memory(args))
            release_host_memory()
        if len(speeds) == 2:
            emit(bench="lora", model=name, what="rptrain_over_peft", ratio=round(speeds["rptrain"] / speeds["peft"], 3))


if __name__ == "__main__":
    main()

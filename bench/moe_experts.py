"""Expert compute of one MoE layer: our layer's forward + backward against the same grouped-GEMM work alone.

moe:    rptrain.models.moe.SparseMoe at a preset's shape (router in fp32, top-k, sort by expert, the two grouped
        GEMMs, the gated activation, the weighted scatter back to the tokens), forward and backward, every
        parameter trainable (full fine-tuning).
gemm:   only the grouped GEMMs of that layer (gate_up and down, forward and the backward's four), with the
        group sizes of the layer's own routing of the same tokens, on rows already sorted, through the same
        kernel (rptrain.models.experts.grouped_mm) and the same weight layouts.
The issue's goal: moe / gemm <= 1.3 (the routing, sorting and scatter cost at most 30% over the matmuls).
lora (record moe_experts_lora, issue 30's LoRA goal): the same layer frozen (only the input's gradient) against
        it with rank --lora-rank adapters on both expert matrices as rptrain applies them (two more grouped
        GEMMs a matrix on the sorted rows, rptrain.models.lora.LoraExperts), and against the adapters merged
        into the weights at every step (W + scaling B A per expert, as PEFT's target_parameters do): where the
        adapters' cost goes before the whole model runs.
Reported per preset: milliseconds of each, the ratio, and the GEMMs' TFLOP/s (2 FLOPs per multiply-add, x3 with the
backward). Tokens are random and the router random-init: the groups are about balanced (a trained router's are not).
"""
from __future__ import annotations

import torch

from common import emit, kernel_times, parser, time_steps
from llm import tiny_overrides
from rptrain.models.experts import _grouped_mm_runs, grouped_mm
from rptrain.models.hf_presets import MOE_PRESETS, qwen3_config
from rptrain.models.lora import apply_lora, expert_delta
from rptrain.models.moe import SparseMoe

def layer(name: str, tiny: bool, device: str, dtype: torch.dtype) -> tuple[SparseMoe, int]:
    cfg = qwen3_config(name, **(tiny_overrides(name) if tiny else {}))  # CI size: llm.py's, the layer's structure kept
    torch.manual_seed(0)
    moe = SparseMoe(cfg.moe, cfg.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe, cfg.hidden_size


def gemm_only(moe: SparseMoe, x: torch.Tensor):
    """A step running only the layer's grouped GEMMs (forward and backward) on its routing of ``x``."""
    experts = moe.experts
    with torch.no_grad():
        _, _, chosen = getattr(moe, moe.router_name)(x)
    choice = chosen.flatten()
    group = choice.sort().values
    offsets = torch.bincount(choice, minlength=experts.n_experts).cumsum(0, dtype=torch.int32)
    w_gate_up = experts.gate_up_proj if experts.interleaved else experts.gate_up_proj.transpose(1, 2)
    w_down = experts.down_proj if experts.interleaved else experts.down_proj.transpose(1, 2)
    rows = x.detach()[choice.argsort(stable=True) // experts.top_k].requires_grad_()
    gated = torch.randn(rows.size(0), w_down.size(1), device=x.device, dtype=x.dtype, requires_grad=True)
    grads = torch.randn(rows.size(0), w_gate_up.size(2), device=x.device, dtype=x.dtype), torch.randn_like(rows)

    def step(_: int) -> None:
        h = grouped_mm(rows, w_gate_up, offsets, group, max_rows=x.size(0))
        y = grouped_mm(gated, w_down, offsets, group, max_rows=x.size(0))
        torch.autograd.backward([h, y], list(grads))

    return step, rows.size(0)


def inputs(args, name: str) -> tuple[SparseMoe, torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer, its dtype, the tokens (their gradient wanted), the routing statistics and an output gradient."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    moe, D = layer(name, args.tiny, args.device, dtype)
    g = torch.Generator(device=args.device).manual_seed(1)
    x = torch.randn(args.tokens, D, device=args.device, dtype=dtype, generator=g).requires_grad_()
    stats = torch.zeros(2, moe.experts.n_experts, device=args.device)
    return moe, dtype, x, stats, torch.randn(1, args.tokens, D, device=args.device, dtype=dtype, generator=g)


def forward_backward(module: torch.nn.Module, x: torch.Tensor, stats: torch.Tensor, grad: torch.Tensor):
    def step(_: int) -> None:
        out, _ = module(x[None], stats)
        out.backward(grad)
    return step


def measure(args, name: str) -> dict:
    moe, dtype, x, stats, grad = inputs(args, name)
    layer_step = forward_backward(moe, x, stats, grad)
    layer_s = time_steps(layer_step, args.steps, args.warmup, args.device)
    if args.profile:
        emit(bench="moe_experts_kernels", model=name, **kernel_times(layer_step, args.device))
    gemm_step, rows = gemm_only(moe, x)
    gemm_s = time_steps(gemm_step, args.steps, args.warmup, args.device)
    e = moe.experts
    macs = rows * (e.gate_up_proj[0].numel() + e.down_proj[0].numel())  # each row through both of its expert's matrices
    return dict(bench="moe_experts", model=name, tokens=args.tokens, rows=rows, dtype=str(dtype).split(".")[1],
                grouped_kernel=_grouped_mm_runs(x, e.down_proj), moe_ms=round(layer_s * 1e3, 3), gemm_ms=round(gemm_s * 1e3, 3),
                ratio=round(layer_s / gemm_s, 3), gemm_tflops=round(6 * macs / gemm_s / 1e12, 1))


def lora_steps(args, name: str) -> dict:
    """The frozen layer, with adapters (rptrain's way) and with them merged each step (PEFT's), forward + backward."""
    moe, dtype, x, stats, grad = inputs(args, name)
    run = lambda module: forward_backward(module, x, stats, grad)  # noqa: E731
    moe.requires_grad_(False)
    frozen_s = time_steps(run(moe), args.steps, args.warmup, args.device)
    adapted = apply_lora(moe, args.lora_rank, 2.0 * args.lora_rank, targets=["experts_gate_up", "experts_down"])
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)  # b is zero at init; a nonzero update keeps every GEMM honest
    lora_s = time_steps(run(adapted), args.steps, args.warmup, args.device)
    if args.profile:
        emit(bench="moe_experts_lora_kernels", model=name, **kernel_times(run(adapted), args.device))
    wrapped = adapted.experts
    base, factors = wrapped.base_layer, wrapped.factors()

    def merged_call():
        """The layer with the plain experts, their frozen matrices replaced by W + scaling B A for this call."""
        merged = {f"experts.{n}": (getattr(base, n).float() + expert_delta(*f.per_expert(), wrapped.scaling, base.interleaved)).to(dtype)
                  for n, f in factors.items()}
        adapted.experts = base
        try:
            return torch.func.functional_call(adapted, merged, (x[None], stats))[0]
        finally:
            adapted.experts = wrapped

    def merged_step(_: int) -> None:
        merged_call().backward(grad)

    with torch.no_grad():  # the two formulations compute the same layer (bf16 on a GPU: within its rounding)
        want, got = adapted(x[None], stats)[0], merged_call()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert (got - want).abs().max() <= tol * want.abs().max(), "the merged adapters compute another layer"
    merged_s = time_steps(merged_step, args.steps, args.warmup, args.device)
    return dict(bench="moe_experts_lora", model=name, tokens=args.tokens, rank=args.lora_rank, frozen_ms=round(frozen_s * 1e3, 3),
                lora_ms=round(lora_s * 1e3, 3), merged_ms=round(merged_s * 1e3, 3), lora_over_frozen=round(lora_s / frozen_s, 3),
                merged_over_frozen=round(merged_s / frozen_s, 3))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", nargs="+", default=list(MOE_PRESETS), choices=list(MOE_PRESETS))
    p.add_argument("--tokens", type=int, default=4 * 4096, help="tokens through the layer per step (4 x 4096: the goals' batch)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also the layer step's costliest kernels (a profiler run)")
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank of the lora record (0: no lora record)")
    args = p.parse_args()
    if args.tiny or args.device == "cpu":
        args.tiny, args.tokens, args.steps, args.warmup = True, 64, 2, 1
    for name in args.model:
        emit(**measure(args, name))
        if args.lora_rank:
            emit(**lora_steps(args, name))


if __name__ == "__main__":
    main()

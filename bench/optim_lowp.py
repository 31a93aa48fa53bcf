"""Issue 29: the host optimizer step per parameter, fp32 AdamW (torch's fused kernel) against the
low-precision variants (rptrain/optim/adam_lowp.py): bf16 master, bf16 or int8 moments, each eager
and compiled (a CPU: rptrain/optim/cpu_kernel.py's C++ loop; a GPU: rptrain/optim/triton_step.py's
kernel, against the eager torch ops over 4 M-element chunks). One flat run of --numel parameters, as the
engine's host share (or GPU share) is; the variants alternate for --rounds rounds and the best counts
(the machine may be shared); one JSON line per variant: ns per parameter, the ratio to fused fp32
AdamW, and GB/s of memory traffic (each of parameter, gradient and state read once, parameter and
state written once). The compiled variants' first step (building the kernel) is build_s.
"""
from __future__ import annotations

import time

import torch

from common import emit, parser, time_steps
from rptrain.optim import AdamW

VARIANTS = [  # (name, master dtype, state_dtype, compile)
    ("fused_fp32", torch.float32, None, False),
    ("bf16_master_eager", torch.bfloat16, None, False),
    ("bf16_master_compiled", torch.bfloat16, None, True),
    ("int8_state_eager", torch.float32, "int8", False),
    ("int8_state_compiled", torch.float32, "int8", True),
    ("bf16_state_compiled", torch.float32, "bf16", True),
    ("lowmem_eager", torch.bfloat16, "int8", False),
    ("lowmem_compiled", torch.bfloat16, "int8", True),
]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--numel", type=int, default=64 * 2**20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="variants alternate, each round; the best round counts")
    p.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    args = p.parse_args()
    numel, steps, rounds = (4096 + 100, 2, 1) if args.tiny else (args.numel, args.steps, args.rounds)
    device = args.device
    runs = {}
    for name, dtype, state_dtype, compiled in VARIANTS:
        if (args.only and name not in args.only) or (args.tiny and compiled):
            continue  # building the compiled step takes minutes on CI's cores
        param = torch.nn.Parameter(torch.randn(numel, device=device).to(dtype))
        param.grad = (torch.randn(numel, device=device) * 1e-3).to(dtype)
        opt = AdamW([param], lr=1e-3, weight_decay=0.01, state_dtype=state_dtype, compile_step=compiled)
        start = time.perf_counter()
        opt.step()  # allocates the state (and builds the compiled step)
        state = opt.state[param]
        moved = sum(t.numel() * t.element_size() * 2 for k, t in state.items() if k != "step" and t.dim() > 0)
        moved += param.numel() * param.element_size() * 2 + param.grad.numel() * param.grad.element_size()
        runs[name] = (opt, time.perf_counter() - start, compiled, [], moved)
    for _ in range(rounds):
        for name, (opt, _, _, times, _) in runs.items():
            times.append(time_steps(lambda i: opt.step(), steps, 1, device))
    fused = min(runs["fused_fp32"][3]) / numel * 1e9 if "fused_fp32" in runs else None
    for name, (opt, first, compiled, times, moved) in runs.items():
        ns = min(times) / numel * 1e9
        emit(bench="optim_lowp", variant=name, device=device, threads=torch.get_num_threads(), numel=numel,
             ns_per_param=round(ns, 3), gb_per_s=round(moved / min(times) / 1e9, 2), over_fused_fp32=round(ns / fused, 3) if fused else None,
             build_s=round(first, 2) if compiled else None)


if __name__ == "__main__":
    main()

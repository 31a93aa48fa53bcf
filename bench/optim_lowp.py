"""Issue 29: the host optimizer step per parameter, fp32 AdamW (torch's fused kernel) against the
low-precision variants (rptrain/optim/adam_lowp.py): bf16 master, bf16 or int8 moments, each eager
and compiled (a CPU: rptrain/optim/cpu_kernel.py's C++ loop; a GPU: rptrain/optim/triton_step.py's
kernel, against the eager torch ops over 4 M-element chunks). One flat run of --numel parameters, as the
engine's host share (or GPU share) is. Each variant runs in its own process (bench/README's rule for a
ratio); the variants alternate for --rounds rounds and each one's best round counts (the machine may be
shared). One JSON line per variant: ns per parameter, the ratio to fused fp32 AdamW, and GB/s of memory
traffic (each of parameter, gradient and state read once, parameter and state written once). The
compiled variants' first step (building the kernel) is build_s. `--cflags="FLAGS"` (repeatable; the = keeps
a leading dash a value) adds the C++ loop built with FLAGS too, as the variant `lowmem_compiled FLAGS` (a
compiler or ISA candidate, measured per machine; `-fopt-info-vec-optimized=FILE` writes which loops the build
vectorized).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from common import emit, parser, time_steps
from rptrain.optim import AdamW, cpu_kernel

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
BY_NAME = {v[0]: v for v in VARIANTS}


def measure(name: str, numel: int, steps: int, device: str, cflags: str = "") -> dict:
    """One variant in this process: seconds per step, the first step's seconds, bytes moved per step."""
    _, dtype, state_dtype, compiled = BY_NAME[name]
    cpu_kernel.extra_cflags = cflags.split()
    param = torch.nn.Parameter(torch.randn(numel, device=device).to(dtype))
    param.grad = (torch.randn(numel, device=device) * 1e-3).to(dtype)
    opt = AdamW([param], lr=1e-3, weight_decay=0.01, state_dtype=state_dtype, compile_step=compiled)
    start = time.perf_counter()
    opt.step()  # allocates the state (and builds the compiled step)
    first = time.perf_counter() - start
    state = opt.state[param]
    moved = sum(t.numel() * t.element_size() * 2 for k, t in state.items() if k != "step" and t.dim() > 0)
    moved += param.numel() * param.element_size() * 2 + param.grad.numel() * param.grad.element_size()
    return {"s": time_steps(lambda i: opt.step(), steps, 1, device), "first_s": first, "moved": moved,
            "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The host's CPU, for the record: the same step runs 3x apart per core on the CI machine's AMD and the GPU host's Xeon."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--numel", type=int, default=64 * 2**20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="variants alternate, each round; the best round counts")
    p.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    p.add_argument("--cflags", action="append", default=[], help="also lowmem_compiled built with these extra flags")
    p.add_argument("--child", help="internal: measure this one variant in this process and print its raw record")
    p.add_argument("--child-cflags", default="", help="internal: the child's extra build flags")
    args = p.parse_args()
    numel, steps, rounds = (4096 + 100, 2, 1) if args.tiny else (args.numel, args.steps, args.rounds)
    if args.child:
        print("RAW " + json.dumps(measure(args.child, numel, steps, args.device, args.child_cflags)), flush=True)
        return
    names = [v[0] for v in VARIANTS if (not args.only or v[0] in args.only) and not (args.tiny and v[3])]  # compiled: minutes on CI
    builds = {name: (name, "") for name in names} | {f"lowmem_compiled {f}": ("lowmem_compiled", f) for f in args.cflags}
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    for _ in range(rounds):
        for i, (name, (variant, cflags)) in enumerate(builds.items()):
            if args.tiny and i > 0:  # CI checks the code, not the speed: one child process is enough to check that path
                runs[name].append(measure(variant, numel, steps, args.device, cflags))
                continue
            cmd = [sys.executable, __file__, "--child", variant, f"--child-cflags={cflags}", "--numel", str(numel), "--steps", str(steps),
                   "--device", args.device]
            out = subprocess.run(cmd + (["--tiny"] if args.tiny else []), capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(next(line for line in out.splitlines() if line.startswith("RAW "))[4:]))
    best = {name: min(records, key=lambda r: r["s"]) for name, records in runs.items()}
    fused = best["fused_fp32"]["s"] / numel * 1e9 if "fused_fp32" in best else None
    cpu = cpu_model()
    for name, record in best.items():
        ns = record["s"] / numel * 1e9
        build = runs[name][0]["first_s"]  # the first process builds the compiled step; later ones load it from the cache
        emit(bench="optim_lowp", variant=name, device=args.device, cpu=cpu, threads=record["threads"], numel=numel,
             ns_per_param=round(ns, 3), gb_per_s=round(record["moved"] / record["s"] / 1e9, 2),
             over_fused_fp32=round(ns / fused, 3) if fused else None, build_s=round(build, 2) if BY_NAME[builds[name][0]][3] else None,
             processes="one per variant and round")


if __name__ == "__main__":
    main()

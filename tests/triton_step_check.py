"""Runs triton_step.py's kernel and adam_lowp.py's eager step side by side (tests/test_optim_triton.py):
on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)."""
from __future__ import annotations

import sys

import torch

from rptrain.optim import adam_lowp, triton_step
from rptrain.optim.adam import _state_layout
from rptrain.optim.flat import FlatState

COMBOS = [(m, s, d) for m in (torch.float32, torch.bfloat16) for s in ("fp32", "bf16", "int8") for d in (True, False)
          if (m, s) != (torch.float32, "fp32")]


def state_for(layout: tuple[FlatState, ...], numel: int, device: str) -> dict[str, torch.Tensor]:
    return {s.name: torch.zeros(s.numel(numel), dtype=s.dtype or torch.float32, device=device) for s in layout}


def mismatches(device: str, numel: int = 5 * 64 * 33 + 77, steps: int = 3) -> list[tuple[str, float, float]]:
    """(what, largest difference relative to |value| + lr, share of elements that differ) where the two steps
    differ in any bit after ``steps`` steps of a run of ``numel`` elements (several programs, a partial
    last block), with a grad scale."""
    bad = []
    for master, state_dtype, decoupled in COMBOS:
        gen = torch.Generator().manual_seed(0)
        p0 = (torch.randn(numel, generator=gen) * torch.logspace(-4, 0, numel)).to(master)
        results = []
        for use_triton in (False, True):
            p = p0.clone().to(device)
            layout = _state_layout(master, state_dtype)
            state = state_for(layout, numel, device)
            step = torch.zeros((), device=device)
            group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
            for i in range(steps):
                g = (torch.randn(numel, generator=torch.Generator().manual_seed(10 + i)) * 1024).to(master).to(device)
                step += 1
                h = adam_lowp.hyper(group, step, torch.tensor(1024.0, device=device))
                if use_triton:
                    seed = (step.to(torch.int64) * adam_lowp._SEED_MIX + 4096) & 0xFFFFFFFF
                    triton_step.step(p, g, state, seed, h, decoupled)
                else:
                    adam_lowp.step_run(p, g, state, step, h, 4096, decoupled, compiled=False)
            results.append({"param": p, **state})
        eager, fused = results
        for name in eager:
            if not torch.equal(eager[name], fused[name]):
                a, b = eager[name].float(), fused[name].float()
                rel = ((a - b).abs() / (a.abs() + group["lr"])).max().item()  # an update is about lr
                share = (a != b).float().mean().item()
                bad.append((f"{master} {state_dtype} decoupled={decoupled} {name}", rel, share))
    return bad


if __name__ == "__main__":
    found = mismatches(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print("\n".join(f"{what}: largest relative difference {rel:.3g}, {share:.2%} differ" for what, rel, share in found) or "bit for bit")
    sys.exit(1 if found else 0)

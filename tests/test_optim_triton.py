"""triton_step.py's fused low-precision Adam(W) step against adam_lowp.py's eager formulas, every master x
state combination with and without decoupled weight decay, 3 steps with a grad scale (the driver:
tests/triton_step_check.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_triton_step_matches_the_eager_step_in_the_interpreter():
    """On the CPU under Triton's interpreter (numpy). torch's CPU sqrt is not correctly rounded (one fp32 step
    off float64's rounded result on about 1 value in 10), the kernel's is: an fp32 master differs by at most
    4 fp32 steps of |weight| + lr (an update's size); a bf16 master's stochastic rounding falls the other
    way where such a difference straddles its threshold: at most one bf16 step, on under 0.1% of the weights.
    Every 8-bit code, scale and bf16 moment here is equal."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = "from tests.triton_step_check import mismatches; print(repr(mismatches('cpu')))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    found = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr of str/float tuples
    assert all(what.endswith(" param") for what, _, _ in found), found
    for what, rel, share in found:
        bf16 = what.startswith("torch.bfloat16")
        assert rel <= (2.0**-7 if bf16 else 4 * 2.0**-23) and (not bf16 or share < 1e-3), (what, rel, share)


@pytest.mark.cuda
def test_triton_step_is_bit_for_bit_the_eager_step_on_a_gpu():
    """On a GPU both use correctly rounded division and square root and no fused multiply-add: every bit equal."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.triton_step_check import mismatches
    assert mismatches("cuda") == []

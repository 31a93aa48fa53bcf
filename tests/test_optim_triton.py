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
    """On the CPU under Triton's interpreter (numpy). A bf16 master is bit for bit the eager step's. An fp32
    master differs by at most 4 fp32 steps of |weight| + lr (an update's size): torch's CPU sqrt is not correctly rounded (it differs
    from numpy's and float64's rounded result by one step on about 1 value in 10), the kernel's is."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = "import sys; from tests.triton_step_check import mismatches; print(repr([(str(m), w, r) for m, w, r in mismatches('cpu')]))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    found = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr of str/float tuples
    assert not [w for m, w, _ in found if m == "torch.bfloat16"], found
    assert all(rel <= 4 * 2.0**-23 for _, _, rel in found), found


@pytest.mark.cuda
def test_triton_step_is_bit_for_bit_the_eager_step_on_a_gpu():
    """On a GPU both use correctly rounded division and square root and no fused multiply-add: every bit equal."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.triton_step_check import mismatches
    assert mismatches("cuda") == []

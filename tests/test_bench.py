"""The benchmarks run at CI size and print one valid JSON object per line (speed is not checked here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


@pytest.mark.parametrize("script", ["limits.py", "resnet.py", "optimizer.py", "llm.py"])
def test_bench_runs_tiny_and_prints_json_lines(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, script, "--device", "cpu", "--tiny"], cwd=BENCH, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines
    for line in lines:
        record = json.loads(line)
        assert isinstance(record, dict) and "bench" in record

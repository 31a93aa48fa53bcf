"""model.weights loads safetensors bit for bit from the memory-mapped file, holding no anonymous copy of it (#29: a guard; measured, it held none before either)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rptrain.models import build_model, load_weights

LOAD_RSS = """
import sys, threading, time, torch
from rptrain.models import build_model, load_weights

def anonymous():  # the mapped file's pages are page cache, counted in RSS but not in RssAnon
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

model = build_model("llama_tiny", vocab_size=512, dim=1024, n_layers=4, device="meta").to_empty(device="cpu")
for t in model.state_dict().values():
    t.zero_()  # its pages are committed before the measurement starts
before, peak, done = anonymous(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.001)
thread = threading.Thread(target=sample)
thread.start()
load_weights(model, sys.argv[1])
done.set()
thread.join()
print(peak[0] - before)
"""


@pytest.mark.slow
def test_safetensors_weights_load_exactly_without_a_copy_of_the_file(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = build_model("llama_tiny", vocab_size=512, dim=1024, n_layers=4)
    state = {k: v.contiguous() for k, v in src.state_dict().items()}
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())  # 190 MB
    out = subprocess.run([sys.executable, "-c", LOAD_RSS, str(path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    assert int(out) < 0.3 * nbytes, (int(out), nbytes)  # the mapped pages are page cache, not a copy
    dst = build_model("llama_tiny", vocab_size=512, dim=1024, n_layers=4, device="meta").to_empty(device="cpu")
    load_weights(dst, path)
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in state.items())

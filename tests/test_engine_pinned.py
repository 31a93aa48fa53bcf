"""engine/pinned.py: pinned host buffers of exactly the size asked for (no power-of-two rounding)."""
from __future__ import annotations

import gc

import pytest
import torch

from rptrain.engine import pinned

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA driver")


def test_rounding_is_predicted_for_the_caching_allocator_only():
    assert pinned.rounding(3 << 20) == (4 << 20) - (3 << 20)  # small blocks: next power of two
    assert pinned.rounding(1 << 20) == 0
    assert pinned.rounding(pinned.EXACT_FROM_BYTES + 1) == 0  # large: mapped at the exact size


def test_unpinned_buffers_are_plain_tensors():
    z = pinned.zeros(1000, torch.float32, pin=False)
    assert z.shape == (1000,) and z.dtype == torch.float32 and not z.any()
    assert pinned.empty(10, torch.bfloat16, pin=False).dtype == torch.bfloat16


@cuda
def test_a_large_pinned_buffer_is_exact_zero_and_copies_asynchronously():
    numel = (pinned.EXACT_FROM_BYTES + 3 * 4096) // 4 + 7  # not a power of two, not page-aligned
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    host = pinned.zeros(numel, torch.float32, pin=True)
    assert host.is_pinned() and host.numel() == numel and not host.any()
    # Not from the caching allocator: its pinned bytes did not grow (it would have taken 128 MiB).
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    src = torch.arange(numel, device="cuda", dtype=torch.float32)
    host.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, src.cpu())
    view = host[5:]
    del host
    gc.collect()
    assert view.is_pinned()  # a view keeps the registration alive
    back = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src[5:])

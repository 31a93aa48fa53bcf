"""The weight copies a resident GPU keeps (resident.py), counted on a simulated GPU (#29)."""
from __future__ import annotations

import torch

from rptrain import RoundPipe
from rptrain.engine.simulated import SimulatedDevice
from rptrain.models import build_model


def test_the_slot_of_the_version_the_live_copy_holds_goes():
    """Synchronous steps with a bf16 master: between calls a GPU keeps the live copy and at most the slot
    of the next version (two copies, not three); asynchronous steps keep the slot of the version the next
    call reads and the one being staged (with the live copy, three: the fit check counts three)."""
    torch.manual_seed(0)
    model = build_model("llama_tiny", vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, dtype=torch.bfloat16)
    engine = RoundPipe(model, torch.bfloat16, devices=[SimulatedDevice(0, 1 << 30)], keep_user_weights=False)
    opt = torch.optim.SGD(list(engine.optim_parameters()), lr=1e-2)
    resident = engine._executor.store.resident[0]
    ids = torch.randint(0, 128, (2, 16))
    # The first synchronous step still finds the slot of the last asynchronous step's version, which no call read.
    for is_async, slots in ((True, 2), (True, 2), (True, 2), (False, 2), (False, 1), (False, 1)):
        engine.forward_backward(input_args=((ids, ids),))
        assert resident.live_version not in resident.staged
        engine.step(opt.step, is_async=is_async)
        engine.wait_for_steps()
        assert len(resident.staged) <= slots, (is_async, sorted(resident.staged))
    engine.synchronize()
    engine.forward_backward(input_args=((ids, ids),))
    assert resident.live_version == engine._versions.required and resident.live_version not in resident.staged
    assert len(resident.staged) <= 1  # the last step's version, which no call read before synchronize() wrote the next
    engine.close()

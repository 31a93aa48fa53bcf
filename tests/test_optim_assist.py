"""A host run's low-precision step with part of it streamed through a GPU (rptrain/optim/assist.py).

Here the "GPU" is the CPU: the same chunks, pieces and kernels run one after another, so the split's
bookkeeping (pieces, block scales, each element's random bits by its index in the whole run) is checked
bit for bit against the unsplit step. The CUDA streams' path runs on the device (bench/gpu_suite.sh).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine.simulated import SimulatedDevice
from rptrain.optim import AdamW
from rptrain.optim.state import state_memory_of
from rptrain.optim.assist import Assist, assisting
from rptrain.optim.lowbit import BLOCK


def run(numel: int, master: torch.dtype, state: str, compiled: bool, helper, steps: int = 3):
    g = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(numel, generator=g).to(master))
    opt = AdamW([p], lr=1e-2, state_dtype=state, compile_step=compiled)
    for _ in range(steps):
        p.grad = torch.randn(numel, generator=g).to(master)
        with assisting(helper):
            opt.step()
    return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}


@pytest.mark.parametrize("master, state", [(torch.bfloat16, "int8"), (torch.bfloat16, "bf16"), (torch.float32, "int8")])
@pytest.mark.parametrize("compiled", [False, True])
def test_an_assisted_step_equals_the_unsplit_one_bit_for_bit(master, state, compiled):
    numel = 7 * BLOCK + 19  # a partial last block on the host's side
    plain = run(numel, master, state, compiled, None)
    helper = Assist(torch.device("cpu"), share=0.6, chunk=2 * BLOCK)  # 4 blocks in 2 chunks, the rest on the host
    assert helper.gpu_part(numel) == 4 * BLOCK
    split = run(numel, master, state, compiled, helper)
    torch.testing.assert_close(split[0], plain[0], rtol=0, atol=0)
    for name, value in plain[1].items():
        torch.testing.assert_close(split[1][name], value, rtol=0, atol=0, msg=name)


def test_the_split_is_whole_blocks_and_share_zero_is_off():
    assert Assist(torch.device("cpu"), 0.7).gpu_part(BLOCK - 1) == 0
    assert Assist(torch.device("cpu"), 0.0).gpu_part(10 * BLOCK) == 0
    assert Assist(torch.device("cpu"), 1.0).gpu_part(10 * BLOCK + 3) == 10 * BLOCK


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 300), nn.Tanh(), nn.Linear(300, 5))


@pytest.mark.parametrize("share", [0.0, 0.7])
def test_a_one_version_engine_assists_its_host_step_and_trains_the_same(share):
    """The engine wraps a synchronous step in the assist where it keeps one version on one GPU (here a
    simulated one): training is bit for bit the engine's without it."""
    def train(tuning_share: float):
        stream = Tuning(resident_share=0.0, resident_share_gpu_state=0.0, host_step_gpu_share=tuning_share)
        engine = RoundPipe(mlp().to(torch.bfloat16), optim_dtype=torch.bfloat16, devices=[SimulatedDevice(0)], tuning=stream, gpu_state=False,
                           single_version=True, optimizer=state_memory_of(AdamW, torch.bfloat16, state_dtype="int8"))
        with OptimizerCtx():
            opt = AdamW(engine.parameters(), lr=1e-2, state_dtype="int8", compile_step=False)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
            engine.forward_backward((x.bfloat16(),), label=y, loss_fn=lambda o, t: nn.functional.cross_entropy(o.float(), t),
                                    run_config=RoundPipeRunConfig(num_microbatch=2))
            engine.step(lambda: (opt.step(), opt.zero_grad()))
        engine.synchronize()
        return engine, [p.detach().clone() for p in engine.parameters()]

    engine, weights = train(share)
    assert (engine._versions.assist is not None) == (share > 0)
    _, reference = train(0.0)
    for a, b in zip(weights, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_streamed_pieces_on_a_gpu_match(compiled):
    """Through CUDA streams and slots (several rounds of them): the eager formulas bit for bit; with the
    compiled kernels (Triton on the GPU, the C++ loop on the host) to their rounding."""
    numel = 40 * BLOCK + 5
    plain = run(numel, torch.bfloat16, "int8", compiled, None)
    helper = Assist(torch.device("cuda"), share=0.8, chunk=3 * BLOCK)  # 32 blocks in 11 chunks through 3 slots
    split = run(numel, torch.bfloat16, "int8", compiled, helper)
    exact = dict(rtol=0, atol=0) if not compiled else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(split[0].float(), plain[0].float(), **exact)

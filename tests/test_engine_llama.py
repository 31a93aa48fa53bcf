"""The Llama-style decoder through the engine trains exactly like plain PyTorch (issue 2's standard),
with tied embeddings split across stages and per-layer recompute."""
from __future__ import annotations

import copy

import pytest
import torch

from reference import Reference, assert_state_close, where_engine_steps
from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.models import build_model, count_tokens
from rptrain.optim import Adam


def tiny(tied: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return build_model("llama_tiny", n_layers=3, tie_embeddings=tied, loss_chunk_tokens=16)


def batches(count=3, batch=4, seq=12, vocab=512):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(
    "plan, grain",
    [(None, None), (ExecutePlan.from_cuts(5, [2, 4], [1, 3, 4]), "stage"), (ExecutePlan.from_cuts(5, [3], [3]), "layer")],
    ids=["auto", "stages", "layer-grain"],
)
def test_llama_through_the_engine_matches_pytorch(tied, plan, grain):
    model = tiny(tied)
    engine = RoundPipe(copy.deepcopy(model))
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    ref = Reference(model, lr=1e-2, device=engine.devices[0].type, master_device=where_engine_steps(engine))
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    for x, y in batches():
        n = count_tokens(y)
        loss = engine.forward_backward(input_args=((x, y),), loss_fn=lambda out, _: out / n, run_config=cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        expected = 0.0
        for xm, ym in zip(x.to(ref.device).chunk(2), y.to(ref.device).chunk(2)):
            part = ref.compute((xm, ym)) / n
            part.backward()
            expected += part.item()
        ref.step()
        assert loss.item() == pytest.approx(expected, rel=1e-5)
    engine.synchronize()
    state = engine.state_dict()
    if tied:
        assert torch.equal(state["0.embed_tokens.weight"], state["4.lm_head.weight"])
    assert_state_close(state, ref.state(), rtol=1e-5, atol=1e-6)

"""Exact action lists of one call (actions.py): streamed vs resident, prefetch, offload, early
sends vs the data-parallel reducer, one vs two devices; and the executor runs exactly that list."""
from __future__ import annotations

import torch
from torch import nn

from rptrain import ExecutePlan, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine.actions import Facts, Sizes, by_device, lower
from rptrain.engine.schedule import training_schedule
from rptrain.engine.simulated import SimulatedDevice

PLAN = ExecutePlan.from_cuts(4, forward=[2], backward=[2])  # jobs: s0 forward 0-1, s1 fused 2-3, s2 backward 0-1


def sizes(a: int, b: int) -> Sizes:  # 1 kB of weights, 4 kB of fp32 gradients per layer; buffers in layers 0-1
    return Sizes(weights=1000 * (b - a), buffers=100 * (b - a) if a == 0 else 0, grads=4000 * (b - a), params=250 * (b - a))


def actions(devices: int = 1, **facts) -> list[str]:
    base = dict(cuda=True, resident=False, cuda_graphs=True, max_graph_params=10**8, reducer=False, num_microbatch=2)
    lowered = lower(training_schedule(PLAN, devices, "stage"), Facts(**{**base, **facts}), sizes)
    return [" | ".join(str(a) for a in acts) for acts in by_device(lowered).values()]


FORWARD = "d0 BUFFERS s0 200B | d0 START s0 | d0 F s0 m0 save | d0 F s0 m1 save | d0 WRITEBACK s0 200B if changed"
BACKWARD = "d0 BUFFERS s2 200B scratch | d0 START s2 | d0 B s2 m0 | d0 B s2 m1 early | d0 SEND s2 8.0kB"


def test_streamed_stages_upload_once_and_prefetch_the_next():
    assert actions() == [" | ".join([
        "d0 UPLOAD s0 2.0kB | d0 PREFETCH s1 2.0kB", FORWARD,
        "d0 BIND s1 prefetched | d0 PREFETCH s2 2.0kB | d0 BUFFERS s1 | d0 START s1 | d0 L s1 m0 | d0 L s1 m1 early | d0 SEND s1 8.0kB",
        "d0 BIND s2 prefetched", BACKWARD])]


def test_resident_weights_bind_and_the_fused_stage_replays_graphs():
    assert actions(resident=True) == [" | ".join([
        "d0 BIND s0 resident", FORWARD,
        "d0 BIND s1 resident | d0 BUFFERS s1 static | d0 START s1 graph | d0 L s1 m0 graph | d0 L s1 m1 graph early-if-eager",
        "d0 SEND s1 8.0kB | d0 BIND s2 resident", BACKWARD])]
    # Past max_graph_params (or while the first call measures) the fused stage runs eagerly.
    assert "graph" not in actions(resident=True, max_graph_params=100)[0]
    assert "graph" not in actions(resident=True, profile=True)[0]


def test_offload_moves_saved_inputs_to_the_host():
    assert "d0 F s0 m0 save>host | d0 F s0 m1 save>host" in actions(offload=True)[0]
    assert "save>host" not in actions(offload=False)[0]
    assert "save>host" not in actions(offload=True, cuda=False)[0]  # on a CPU they are in host memory anyway


def test_a_reducer_sends_each_stage_whole_after_its_backward():
    [reduced] = actions(reducer=True)
    assert "early" not in reduced and "SEND" not in reduced
    assert "d0 L s1 m1 | d0 REDUCE s1 8.0kB" in reduced and reduced.endswith("d0 B s2 m1 | d0 REDUCE s2 8.0kB")


def test_two_devices_split_the_jobs_round_robin():
    assert actions(devices=2) == [
        " | ".join(["d0 UPLOAD s0 2.0kB | d0 PREFETCH s2 2.0kB", FORWARD, "d0 BIND s2 prefetched", BACKWARD]),
        "d1 UPLOAD s1 2.0kB | d1 BUFFERS s1 | d1 START s1 | d1 L s1 m0 | d1 L s1 m1 early | d1 SEND s1 8.0kB",
    ]


def test_the_executor_runs_exactly_the_explained_actions_and_lowers_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    engine = RoundPipe(model, devices=[SimulatedDevice(0, memory=2_000), SimulatedDevice(1, memory=2_000)],
                       model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN), tuning=Tuning(offload_activations=True))
    text = engine.explain(torch.randn(6, 4))
    assert "weights streamed per stage" in text and "input m0: (3, 4) float32 (48B)" in text
    expected = [line.strip() for line in text.splitlines() if line.startswith("  d")]
    ran: list[str] = []
    handlers = engine._executor._handlers
    for op, handler in list(handlers.items()):
        handlers[op] = lambda run, action, state, handler=handler: (ran.append(str(action)), handler(run, action, state))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    for _ in range(2):
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.cross_entropy)
    assert sorted(ran) == sorted(expected * 2)  # two device threads interleave; each device keeps its order
    for d in ("d0", "d1"):
        assert [a for a in ran if a.startswith(d)] == [a for a in expected if a.startswith(d)] * 2
    assert len(engine._executor._lowered) == 1  # the second call reused the first call's lowering
    engine.close()


def test_a_wrapped_model_explains_every_engine():
    from rptrain import wrap_model

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x))

    text = wrap_model(Net()).explain()
    where = "cuda:0" if torch.cuda.is_available() else "cpu"  # the engine runs on the GPU when there is one
    assert f"blocks.0:\nRoundPipe: 1 layer on {where}" in text and "blocks.1:" in text
    assert "d0 SEND s0 288B" in text  # 8 x 8 + 8 fp32 gradients


def test_explain_shows_the_measuring_call_then_the_measured_plan():
    """On a (simulated) GPU the first call measures one layer per stage; explain says so, and after
    it shows the plan made from the measurements with the bytes each forward stage saves."""
    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)),
                       devices=[SimulatedDevice(0), SimulatedDevice(1)],
                       model_run_config=RoundPipeRunConfig(num_microbatch=2, recompute_grain="layer"))
    first = engine.explain(torch.randn(4, 4))
    assert "this call measures every layer" in first and "weights resident on every GPU" in first
    assert first.count(" fused ") == 1 and first.count(" forward ") == 4  # one layer per stage
    engine.forward_backward(input_args=(torch.randn(4, 4),), label=torch.randint(0, 3, (4,)), loss_fn=nn.functional.cross_entropy)
    after = engine.explain(torch.randn(4, 4))
    assert "measures" not in after and len(engine.plan.forward) > 1  # the fused last stage is the smallest
    widths = [8, 8, 8, 8, 3]  # each layer's output features; a microbatch has 2 rows of fp32
    for k, (a, b) in enumerate(engine.plan.forward[:-1]):  # layer grain: every layer's input is saved (layer 0's is the call's)
        saved = sum(2 * widths[c - 1] * 4 for c in range(max(a, 1), b))
        assert f"s{k} forward  layers {a}-{b - 1} on d{k % 2}" in after and f"saves inputs of layers {list(range(a, b))} ({saved}B per microbatch)" in after
    engine.close()

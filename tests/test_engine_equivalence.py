"""The engine trains exactly like plain PyTorch (tests/reference.py), on CPU and, through `device`, CUDA.

Tolerances: fp32 models rtol 1e-5 (microbatch sums and the fused vs foreach Adam kernels differ
only in rounding); fp16 compute with fp32 master: rtol/atol 2e-3 on the fp32 master weights.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from reference import Reference, assert_state_close, ran_as_one_batch, split, where_engine_steps
from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.optim import Adam

ONE = RoundPipeRunConfig(num_microbatch=1)  # the default is GPUs + 1: pin it where the reference uses one


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def convnet(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(dropout),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def make_engine(model: nn.Module, lr: float = 1e-2, **kw):
    engine = RoundPipe(copy.deepcopy(model), **kw)
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=lr)
    return engine, opt


def train_both(model, batches, n, plan=None, delayed=False, loss_fn=None, grain=None, devices=None, lr=1e-2, engine_async=None, **engine_kw):
    """``delayed``: the reference's staleness and the engine's ``is_async`` (``engine_async`` sets that alone)."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    engine, opt = make_engine(model, lr=lr, devices=devices, **engine_kw)
    # The reference runs where the engine computes: Adam turns rounding differences between CPU
    # and GPU kernels in near-zero gradients into lr-sized steps.
    ref = Reference(model, lr=lr, delayed=delayed, device=engine.devices[0].type, master_device=where_engine_steps(engine))
    cfg = RoundPipeRunConfig(num_microbatch=n, execute_plan=plan, recompute_grain=grain)

    def step():
        opt.step()
        opt.zero_grad()

    for x, y in batches:
        loss = engine.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=cfg)
        engine.step(step, is_async=delayed if engine_async is None else engine_async)
        expected = ref.forward_backward(x, y, n, loss_fn, fused=ran_as_one_batch(engine))
        ref.step()
        assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    engine.synchronize()
    return engine, ref


def image_batches(count=4, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(count)]


def vector_batches(count=4, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(count)]


PLANS_7 = [
    None,  # the planner's choice
    ExecutePlan.single_stage(7),
    ExecutePlan.per_layer(7),
    ExecutePlan.from_cuts(7, forward=[2, 5], backward=[1, 3, 5]),  # different forward and backward boundaries
]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("plan", PLANS_7, ids=["auto", "single", "per_layer", "split_boundaries"])
def test_mlp_sync_matches_pytorch(n, plan):
    engine, ref = train_both(mlp(), vector_batches(), n, plan=plan)
    assert_state_close(engine.state_dict(), ref.state())


@pytest.fixture(params=["inline", "thread"])
def optimizer_thread(request):
    """CPU engines step inline by default; the real optimizer thread must give the same numbers."""
    return Tuning(cpu_optimizer_thread=request.param == "thread")


@pytest.mark.parametrize("plan", [ExecutePlan.single_stage(7), ExecutePlan.from_cuts(7, [3, 5], [2, 5])], ids=["single", "multi"])
def test_mlp_async_matches_one_step_delay(plan, optimizer_thread):
    engine, ref = train_both(mlp(), vector_batches(count=6), 2, plan=plan, delayed=True, tuning=optimizer_thread)
    assert_state_close(engine.state_dict(), ref.state())


def test_async_is_really_one_step_stale():
    """Guard against a reference that accidentally agrees with anything: sync and async differ."""
    sync_engine, _ = train_both(mlp(), vector_batches(count=3), 1)
    async_engine, _ = train_both(mlp(), vector_batches(count=3), 1, delayed=True)
    a, b = sync_engine.state_dict()["0.weight"], async_engine.state_dict()["0.weight"]
    assert (a - b).abs().max() > 1e-4


@pytest.mark.parametrize("n", [1, 2, 4])
def test_convnet_batchnorm_matches_pytorch_including_running_stats(n):
    plan = ExecutePlan.from_cuts(10, forward=[3, 6], backward=[2, 6])
    engine, ref = train_both(convnet(), image_batches(), n, plan=plan)
    assert_state_close(engine.state_dict(), ref.state())  # running_mean/var/num_batches_tracked included
    # Eval forward uses the running statistics, like PyTorch in eval mode.
    x = torch.randn(5, 3, 8, 8)
    engine.eval()
    ref.compute.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), ref.compute(x.to(ref.device)).cpu(), rtol=1e-5, atol=1e-6)


def test_dropout_recompute_replays_rng():
    """A recomputed stage with Dropout must draw the same mask as its forward did."""
    plan = ExecutePlan.from_cuts(10, forward=[4, 8], backward=[4, 8])  # Dropout (layer 6) is recomputed
    batches = image_batches(count=3)
    torch.manual_seed(123)
    engine, opt = make_engine(convnet(dropout=0.5))
    ref = Reference(convnet(dropout=0.5))
    cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=plan)
    for x, y in batches:
        torch.manual_seed(7)
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        torch.manual_seed(7)
        ref.forward_backward(x, y, 1, nn.CrossEntropyLoss())
        ref.step()
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())


def test_dropout_without_rng_replay_differs():
    """Sanity check of the test above: with preserve_rng_state=False the masks differ."""
    plan = ExecutePlan.from_cuts(10, forward=[4, 8], backward=[4, 8])
    x, y = image_batches(count=1)[0]
    grads = []
    for preserve in (True, False):
        engine, _ = make_engine(convnet(dropout=0.5))
        torch.manual_seed(7)
        cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=plan, preserve_rng_state=preserve)
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=cfg)
        grads.append(torch.cat([v.flatten().cpu() for v in engine._host.grads[0].views]))  # host and GPU share
    assert not torch.allclose(grads[0], grads[1])


def test_uneven_microbatches():
    batches = vector_batches(count=3, batch=7)  # 7 = 3 + 2 + 2
    engine, ref = train_both(mlp(), batches, 3, plan=ExecutePlan.from_cuts(7, [2, 4], [2, 4]))
    assert_state_close(engine.state_dict(), ref.state())


class MixInput(nn.Module):
    """A first layer with positional, nested and keyword inputs, returning a nested output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)

    def forward(self, x, pair, scale=None, extra=None):
        h = self.a(x) + self.b(pair[0] * pair[1])
        return {"h": h * scale, "skip": (x, extra["offset"])}


class UseNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, d):
        x, offset = d["skip"]
        return (self.lin(torch.relu(d["h"])) + x + offset, offset)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, t):
        return self.lin(t[0])


def nested_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MixInput(), UseNested(), Head())


@pytest.mark.parametrize("plan", [ExecutePlan.per_layer(3), ExecutePlan.single_stage(3)], ids=["per_layer", "single"])
def test_kwargs_and_nested_inputs(plan):
    g = torch.Generator().manual_seed(3)
    engine, opt = make_engine(nested_model())
    ref = Reference(nested_model(), device="cpu")
    scale = torch.tensor(0.5)  # 0-dim: handed to every microbatch
    for _ in range(3):
        x, p0, p1 = (torch.randn(6, 8, generator=g) for _ in range(3))
        offset = torch.randn(6, 8, generator=g)
        y = torch.randint(0, 4, (6,), generator=g)
        loss = engine.forward_backward(
            input_args=(x, (p0, p1)), input_kwargs={"scale": scale, "extra": {"offset": offset}}, label=y,
            loss_fn=nn.CrossEntropyLoss(), run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
        )
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        expected = 0.0
        for xm, p0m, p1m, om, ym in zip(split(x, 2), split(p0, 2), split(p1, 2), split(offset, 2), split(y, 2)):
            out = ref.compute[2](ref.compute[1](ref.compute[0](xm, (p0m, p1m), scale=scale, extra={"offset": om})))
            l = nn.CrossEntropyLoss()(out, ym)
            l.backward()
            expected += l.item()
        ref.step()
        assert loss.item() == pytest.approx(expected, rel=1e-5)
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())


def test_gradient_accumulation_over_two_calls():
    batches = vector_batches(count=4)
    plan = ExecutePlan.from_cuts(7, [3], [3])
    engine, opt = make_engine(mlp())
    ref = Reference(mlp())
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    for (x1, y1), (x2, y2) in zip(batches[::2], batches[1::2]):
        for x, y in ((x1, y1), (x2, y2)):
            engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=cfg)
            ref.forward_backward(x, y, 2, nn.CrossEntropyLoss())
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref.step()
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())


@pytest.mark.parametrize("is_async", [False, True])
def test_synchronize_between_backward_and_step_keeps_gradients(is_async, optimizer_thread):
    batches = vector_batches(count=4)
    engine, opt = make_engine(mlp())
    ref = Reference(mlp(), delayed=is_async)
    for i, (x, y) in enumerate(batches):
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=ONE)
        if i == 2:
            engine.synchronize()  # waits for the pending step, refreshes weights; gradients stay
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        ref.forward_backward(x, y, 1, nn.CrossEntropyLoss())
        ref.step()  # still one step stale after synchronize(): iteration 3 runs at the weights after 2 steps
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())


def test_user_keeps_gradients_without_zero_grad(optimizer_thread):
    """Without zero_grad() the master gradients keep accumulating, as in PyTorch."""
    batches = vector_batches(count=3)
    engine, opt = make_engine(mlp(), lr=1e-3)
    master = copy.deepcopy(mlp())
    ropt = torch.optim.Adam(master.parameters(), lr=1e-3)
    for x, y in batches:
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=ONE)
        engine.step(opt.step, is_async=False)
        nn.CrossEntropyLoss()(master(x), y).backward()
        ropt.step()
    engine.synchronize()
    for name, p in master.named_parameters():
        torch.testing.assert_close(engine.state_dict()[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_fp16_model_fp32_master():
    model = convnet().half()
    plan = ExecutePlan.from_cuts(10, [3, 6], [2, 6])
    batches = [(x.half(), y) for x, y in image_batches(count=3)]
    loss_fn = lambda out, y: nn.functional.cross_entropy(out.float(), y)
    engine, opt = make_engine(model)
    ref = Reference(model)
    for x, y in batches:
        loss = engine.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        expected = ref.forward_backward(x, y, 2, loss_fn)
        ref.step()
        assert loss.item() == pytest.approx(expected, rel=2e-3)
    engine.synchronize()
    state = engine.state_dict()
    assert state["0.weight"].dtype == torch.float32  # master copy
    assert_state_close(state, ref.state(), rtol=2e-3, atol=2e-3)
    # After synchronize() the compute copy is the master cast to fp16.
    assert engine.model[0].weight.dtype == torch.float16
    torch.testing.assert_close(engine.model[0].weight.cpu(), state["0.weight"].half(), rtol=0, atol=0)  # GPU share: on the GPU


def test_layer_grain_recompute():
    engine, ref = train_both(convnet(), image_batches(), 2, plan=ExecutePlan.from_cuts(10, [4, 7], [3, 7]), grain="layer")
    assert_state_close(engine.state_dict(), ref.state())


MULTI = [["cpu", "cpu", "cpu"]] + ([["cuda:0", "cuda:0"]] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("devices", MULTI, ids=lambda d: f"{len(d)}x{d[0]}")
def test_several_devices_match_one(devices):
    """Several workers, each with its own thread (and, on CUDA, its own streams), run the
    round-robin schedule; cross-device hand-offs are ordered by events."""
    plan = ExecutePlan.from_cuts(10, [2, 4, 6, 8], [3, 5, 8])
    # Several devices keep the microbatches apart; one GPU would join them (fused_call.py), which only
    # rounds differently, yet Adam turns that into lr-sized steps where a gradient is near zero (seen:
    # 1.5e-2 on an H100, TF32 off). Compare like with like: the single device also runs them apart.
    apart = Tuning(fuse_microbatches=False)
    one, _ = train_both(convnet(), image_batches(), 3, plan=plan, devices=devices[:1], tuning=apart)
    several, ref = train_both(convnet(), image_batches(), 3, plan=plan, devices=devices)
    assert_state_close(several.state_dict(), ref.state())
    # Bitwise on an idle machine; otherwise each worker thread's CPU convolutions may split their
    # reductions differently (seen: 4e-8 on a 16-core host, 2.4e-7 on 2 loaded cores), and the
    # microbatches' gradients are added in the order the workers finish them.
    assert_state_close(several.state_dict(), one.state_dict(), rtol=1e-5, atol=1e-6)


class Embed(nn.Module):
    def __init__(self, shared: nn.Parameter):
        super().__init__()
        self.weight = shared

    def forward(self, ids):
        return self.weight[ids].mean(1)


class Unembed(nn.Module):
    def __init__(self, shared: nn.Parameter):
        super().__init__()
        self.weight = shared

    def forward(self, h):
        return h @ self.weight.t()


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    shared = nn.Parameter(torch.randn(12, 16) * 0.1)
    return nn.Sequential(Embed(shared), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), Unembed(shared))


def token_batches(count=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 12, (6, 3), generator=g), torch.randint(0, 12, (6,), generator=g)) for _ in range(count)]


@pytest.mark.parametrize("plan", [ExecutePlan.single_stage(5), ExecutePlan.from_cuts(5, [2, 4], [1, 4])], ids=["single", "multi"])
def test_tied_weights(plan):
    engine, ref = train_both(tied_model(), token_batches(), 2, plan=plan)
    state = engine.state_dict()
    assert state["0.weight"] is state["4.weight"] or torch.equal(state["0.weight"], state["4.weight"])
    assert_state_close(state, ref.state())


def test_frozen_parameters_stay_put():
    model = mlp()
    model[0].weight.requires_grad_(False)
    engine, ref = train_both(model, vector_batches(count=2), 2)
    assert_state_close(engine.state_dict(), ref.state())
    torch.testing.assert_close(engine.state_dict()["0.weight"], model[0].weight.detach())


@pytest.mark.parametrize("plan", [ExecutePlan.single_stage(7), ExecutePlan.from_cuts(7, [2, 5], [1, 3, 5])], ids=["single", "multi"])
def test_forward_with_autograd_backward(plan):
    """``loss = f(model(x)); loss.backward()`` runs the pipeline backward, input gradients included."""
    engine, opt = make_engine(mlp())
    ref = Reference(mlp(), device="cpu")
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    for x, y in vector_batches(count=3):
        x1 = x.clone().requires_grad_(True)
        out = engine(x1, run_config=cfg)
        loss = nn.functional.cross_entropy(out, y, reduction="sum")
        loss.backward()
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        x2 = x.clone().requires_grad_(True)
        ref_loss = nn.functional.cross_entropy(ref.compute(x2), y, reduction="sum")
        ref_loss.backward()
        ref.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())


def test_eval_forward_matches_and_uses_output_device():
    engine, _ = make_engine(convnet())
    x = torch.randn(7, 3, 8, 8)
    ref = convnet()
    engine.eval()
    ref.eval()
    with torch.no_grad():
        out = engine(x, run_config=RoundPipeRunConfig(num_microbatch=3))
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["simulated", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_no_grad_forward_of_a_resident_stage_replays_a_forward_graph(where):
    """An evaluation (torch.no_grad) of a resident model's one stage records a forward graph and replays it: the
    outputs equal plain PyTorch's and are the call's own (not the graph's memory, which the next replay overwrites),
    in eval mode and in train mode (BatchNorm's running statistics updated once a call, as eagerly)."""
    from rptrain.engine.simulated import SimulatedDevice

    devices = [SimulatedDevice(0)] if where == "simulated" else ["cuda:0"]
    engine, _ = make_engine(convnet(), devices=devices)
    x, y = image_batches(count=1)[0]  # a training call first, as the CLI's: it plans the model as one stage
    engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=ONE)
    engine.synchronize()
    ref = convnet().to(engine.devices[0])
    ref.load_state_dict(engine.state_dict())
    xs = [torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for training in (False, True):
        engine.train(training)
        ref.train(training)
        with torch.no_grad():
            # Unmerged: the microbatch's own output tensor, not a concatenation's copy.
            outs = [engine(x, run_config=RoundPipeRunConfig(num_microbatch=1, merge_output=False))[0] for x in xs]
            refs = [ref(x.to(engine.devices[0])).cpu() for x in xs]
        for out, expected in zip(outs, refs):  # the first calls' outputs survive the later replays
            torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)
    [graphs] = engine._executor._graphs.values()
    assert sum(key[3] == "forward" and rec is not None for key, rec in graphs._graphs.items()) == 2  # one a mode
    state = {k: v for k, v in engine.state_dict().items() if "running" in k}
    for k, v in state.items():  # three train-mode calls' statistics, as plain PyTorch's
        torch.testing.assert_close(v.cpu(), ref.state_dict()[k].cpu(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # a shape met once (a generation's next length) runs eagerly; recorded when it comes back
        engine(torch.randn(5, 3, 8, 8), run_config=ONE)
        assert sum(key[3] == "forward" for key in graphs._graphs) == 2
        engine(torch.randn(5, 3, 8, 8), run_config=ONE)
        assert sum(key[3] == "forward" for key in graphs._graphs) == 3
    engine.close()


def test_return_outputs_are_merged_in_order():
    engine, _ = make_engine(mlp())
    x, y = vector_batches(count=1, batch=7)[0]
    loss, out = engine.forward_backward(
        input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), return_outputs=True, run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    torch.testing.assert_close(out, mlp()(x), rtol=1e-5, atol=1e-6)
    assert not out.requires_grad


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_offloaded_activations_match(grain):
    """Saved activations parked in pinned host memory (long sequences) give the same training.
    (On a CPU-only machine the activations are in host memory anyway.)"""
    engine, ref = train_both(convnet(), image_batches(), 2, plan=ExecutePlan.from_cuts(10, [4, 7], [3, 7]), grain=grain,
                             tuning=Tuning(offload_activations=True))
    assert_state_close(engine.state_dict(), ref.state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_fused_stage_replays_as_cuda_graphs_and_matches(cuda_graphs):
    """The resident fused stage is recorded and replayed (and still matches PyTorch), unless asked not to."""
    engine, ref = train_both(convnet(), image_batches(), 2, cuda_graphs=cuda_graphs)
    assert_state_close(engine.state_dict(), ref.state())
    graphs = [rec for g in engine._executor._graphs.values() for rec in g._graphs.values() if rec is not None]
    graphs += [rec for g in engine._executor._whole.values() for rec in g._recorded.values() if rec is not None]  # one stage: the whole call's
    assert bool(graphs) == cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_big_stages_run_eagerly_and_match():
    """Past Tuning.max_graph_params the fused stage runs eagerly (its gradients leave during the backward)."""
    engine, ref = train_both(convnet(), image_batches(), 2, cuda_graphs=True, tuning=Tuning(max_graph_params=100))
    assert_state_close(engine.state_dict(), ref.state())
    assert not [rec for g in engine._executor._graphs.values() for rec in g._graphs.values() if rec is not None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_input_shapes_past_the_recording_limit_run_eagerly():
    """Every batch size records its own graphs; past the limit new sizes run eagerly, still exact."""
    batches = [b for size in (4, 6, 8, 10) for b in image_batches(count=1, batch=size)]
    engine, ref = train_both(convnet(), batches, 1, tuning=Tuning(max_recorded_graphs=2, whole_call_graphs=False))  # the stage's graphs
    assert_state_close(engine.state_dict(), ref.state())
    [stage_graphs] = engine._executor._graphs.values()
    assert sum(rec is not None for rec in stage_graphs._graphs.values()) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_stages_too_large_for_a_graph_run_eagerly():
    """A stage whose saved activations exceed the graph memory share is never recorded (neither the whole
    call nor the stage), still exact."""
    with pytest.warns(UserWarning, match="max_graph_memory_share"):
        engine, ref = train_both(convnet(), image_batches(count=3), 1, tuning=Tuning(max_graph_memory_share=1e-9))
    assert_state_close(engine.state_dict(), ref.state())
    [stage_graphs] = engine._executor._graphs.values()
    assert stage_graphs._graphs and all(rec is None for rec in stage_graphs._graphs.values())
    [whole] = engine._executor._whole.values()
    assert whole._recorded and all(rec is None for rec in whole._recorded.values()) and "max_graph_memory_share" in whole.fallback


def test_gradients_go_home_during_the_last_backward(monkeypatch):
    """Each parameter's gradient is sent as soon as the last microbatch's backward has
    accumulated it (one piece per tensor, before the stage ends), and training still matches."""
    from rptrain.engine.grads import GradSink

    calls = []
    send = GradSink.send
    monkeypatch.setattr(GradSink, "send", lambda self, device, job, pieces, state: (calls.append(len(pieces)), send(self, device, job, pieces, state)))
    engine, ref = train_both(tied_model(), token_batches(), 2, plan=ExecutePlan.from_cuts(5, [2], [2]))
    assert_state_close(engine.state_dict(), ref.state())
    assert calls.count(1) >= 2 * 3  # single tensors, every call

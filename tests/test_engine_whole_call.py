"""The whole-call path (engine/callpath.py, engine/wholecall.py): which calls replay one recorded graph
and why the others do not, on the CPU; training through it on a SimulatedDevice (each replay run
eagerly, the scales read from their device tensors) against plain PyTorch (tests/reference.py, fp32:
rtol 1e-5) and against the stage-by-stage path. The ``cuda`` parameters (``-m cuda``) run the same tests
through real CUDA graphs, plus the checks only a real capture can make."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from reference import assert_state_close
from rptrain import ExecutePlan, GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine.actions import Facts, Op, Sizes, lower_call
from rptrain.engine.callpath import decide
from rptrain.engine.schedule import training_schedule
from rptrain.engine.simulated import SimulatedDevice
from rptrain.engine.loss_key import loss_key
from rptrain.optim import Adam
from test_engine_equivalence import convnet, image_batches, train_both
from test_engine_scaler import ScaledReference, batches as overflow_batches, loss_fn as fp16_loss, model16

SINGLE = ExecutePlan.single_stage(10)
BASE = dict(cuda=True, whole_call=True, graphed=True, reducer=False, profile=False, offload=False)


def fused_jobs(plan: ExecutePlan = SINGLE, devices: int = 1):
    return training_schedule(plan, devices, "stage")


def test_one_resident_fused_stage_takes_the_whole_call_path():
    path = decide(fused_jobs(), **BASE)
    assert path.whole and not path.reasons
    assert str(path).startswith("call path: whole call as one CUDA graph")


@pytest.mark.parametrize("change, reason", [
    (dict(cuda=False), "no GPU"),
    (dict(whole_call=False), "Tuning.whole_call_graphs=False"),
    (dict(profile=True), "measures every layer"),
    (dict(graphed=False), "not replayed as CUDA graphs"),
    (dict(reducer=True), "averaged across processes"),
    (dict(offload=True), "saved activations go to the host"),
])
def test_each_obstacle_sends_the_call_stage_by_stage_and_says_why(change, reason):
    path = decide(fused_jobs(), **{**BASE, **change})
    assert not path.whole and any(reason in r for r in path.reasons), path.reasons
    assert str(path).startswith("call path: stage by stage: ")


def test_several_stages_or_devices_take_the_stage_path():
    staged = decide(fused_jobs(ExecutePlan.from_cuts(10, [4], [4])), **BASE)
    assert not staged.whole and "3 stages (the whole call needs a single stage)" in staged.reasons
    two = decide(fused_jobs(ExecutePlan.from_cuts(10, [4], [4]), devices=2), **BASE)
    assert "2 devices" in two.reasons


def sizes(start: int, stop: int) -> Sizes:
    return Sizes(1000, 100, 4000, 1000)


@pytest.mark.parametrize("whole", [True, False])
def test_lowering_turns_the_microbatches_into_one_call_action(whole):
    facts = Facts(cuda=True, resident=True, cuda_graphs=True, max_graph_params=10**8, reducer=False, num_microbatch=3, whole_call=whole)
    [item], path = lower_call(fused_jobs(), facts, sizes)
    ops = [a.op for a in item.actions]
    if whole:
        assert path.whole and ops == [Op.BIND, Op.BUFFERS, Op.START, Op.CALL, Op.SEND, Op.WRITEBACK]
        assert str(item.actions[3]) == "d0 W s0 m0-2 whole-call graph" and not item.early
    else:
        assert not path.whole and ops.count(Op.FUSED) == 3 and Op.CALL not in ops


def test_loss_keys_compare_code_and_closure_not_function_objects():
    criterion, other = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()

    def tutorial(crit, n):  # a new lambda every call, as the tutorial writes it
        return lambda out, y: crit(out.float(), y) / n

    assert loss_key(tutorial(criterion, 2)) == loss_key(tutorial(criterion, 2))
    assert loss_key(tutorial(criterion, 2)) != loss_key(tutorial(criterion, 3))  # numbers by value
    assert loss_key(tutorial(criterion, 2)) != loss_key(tutorial(other, 2))  # objects by identity
    assert loss_key(criterion) == loss_key(criterion) != loss_key(other)
    assert loss_key(functools.partial(nn.functional.cross_entropy, label_smoothing=0.1)) != loss_key(
        functools.partial(nn.functional.cross_entropy, label_smoothing=0.2))


WHERE = ["simulated", pytest.param("cuda", marks=pytest.mark.cuda)]


def sim(tuning: Tuning = Tuning(), where: str = "simulated") -> dict:
    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return dict(devices=["cuda:0"] if where == "cuda" else [SimulatedDevice(0)], tuning=tuning)


def whole_graphs(engine: RoundPipe):
    [graphs] = engine._executor._whole.values()
    if engine.devices[0].type == "cuda":  # a real recording, not the simulated eager one
        assert all(rec is None or isinstance(rec.graph, torch.cuda.CUDAGraph) for rec in graphs._recorded.values())
    return graphs


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("delayed", [False, True])
def test_training_through_the_whole_call_matches_pytorch_and_the_stage_path(delayed, where):
    """The planner's plan (the first call measures, the second records, the rest replay), BatchNorm
    statistics included, against plain PyTorch and the stage path at rtol 1e-5."""
    batches = image_batches(count=5)
    whole, ref = train_both(convnet(), batches, 2, delayed=delayed, **sim(where=where))
    assert_state_close(whole.state_dict(), ref.state())
    graphs = whole_graphs(whole)
    assert len(graphs._recorded) == 1 and graphs.fallback is None  # one shape, recorded once, replayed since
    staged, _ = train_both(convnet(), batches, 2, delayed=delayed, **sim(Tuning(whole_call_graphs=False), where))
    assert not staged._executor._whole
    assert_state_close(whole.state_dict(), staged.state_dict())
    whole.close()
    staged.close()


@pytest.mark.parametrize("where", WHERE)
def test_returned_losses_and_outputs_are_the_callers_own(where):
    """A replay writes the same memory every time: what a call returned must not change with the next."""
    engine = RoundPipe(convnet(), **sim(where=where))
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=SINGLE)
    (x1, y1), (x2, y2) = image_batches(count=2)
    first = engine.forward_backward(input_args=(x1,), label=y1, loss_fn=nn.CrossEntropyLoss(), return_outputs=True, run_config=cfg)
    kept = (first[0].clone(), first[1].clone())
    engine.forward_backward(input_args=(x2,), label=y2, loss_fn=nn.CrossEntropyLoss(), return_outputs=True, run_config=cfg)
    assert torch.equal(first[0], kept[0]) and torch.equal(first[1], kept[1])
    engine.close()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("delayed", [False, True])
def test_a_changing_scale_is_read_at_each_replay(delayed, where):
    """fp16 compute, GradScaler through an overflow (the scale changes every step): the same skipped
    step and final scale as plain PyTorch, masters within 2e-3, on one recording."""
    engine = RoundPipe(model16(), **sim(where=where))
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0**10, growth_interval=1)
    ref = ScaledReference(model16(), delayed, 2.0**10, 1)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=ExecutePlan.single_stage(5))
    skipped = []
    for x, y in overflow_batches():
        engine.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(fp16_loss(o, t)), run_config=cfg)
        engine.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=delayed)
        scaler.update()
        skipped.append(ref.iteration(x, y, 2))
    assert skipped[2] and not any(skipped[:2]) and scaler.get_scale() == ref.scale
    assert len(whole_graphs(engine)._recorded) == 1
    engine.synchronize()
    state = engine.state_dict()
    for name, p in ref.master.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=2e-3, atol=2e-3)
    engine.close()


def test_calls_it_cannot_hold_run_stage_by_stage_and_explain_says_why():
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=SINGLE)
    engine = RoundPipe(convnet(), model_run_config=cfg, **sim(Tuning(max_recorded_graphs=1)))  # explain() reads the engine's
    x, y = image_batches(count=1)[0]
    loss = engine.forward_backward(input_args=(x.requires_grad_(),), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=cfg)
    assert x.grad is not None and torch.isfinite(loss)  # the stage path computed the input's gradient
    assert "the last call ran stage by stage: inputs need gradients" in engine.explain(x)
    x = x.detach()
    engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=cfg)
    assert whole_graphs(engine).fallback is None and "the last call ran" not in engine.explain(x)
    with pytest.warns(UserWarning, match="call shapes already recorded"):
        engine.forward_backward(input_args=(x[:4],), label=y[:4], loss_fn=nn.CrossEntropyLoss(), run_config=cfg)
    assert "Tuning.max_recorded_graphs" in engine.explain(x)
    engine.close()


def test_a_loss_fn_with_side_effects_runs_stage_by_stage_with_its_effects_once():
    """A loss_fn appending to a list it closes over (the CLI's old correct count) would append nothing
    on a replay: recording notices, puts the list back and the call runs stage by stage."""
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=SINGLE)
    engine = RoundPipe(convnet(), model_run_config=cfg, **sim())
    x, y = image_batches(count=1)[0]
    seen: list = []

    def counting(out, lab):
        seen.append(out.shape[0])
        return nn.functional.cross_entropy(out, lab)

    with pytest.warns(UserWarning, match="changes a list, dict or set it closes over"):
        engine.forward_backward(input_args=(x,), label=y, loss_fn=counting)
    assert seen == [4, 4]  # the stage path's two microbatches; the recording's calls were taken back
    assert "changes a list, dict or set" in engine.explain(x)
    engine.close()


def test_a_closure_changing_every_call_stops_being_recorded():
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=SINGLE)
    engine = RoundPipe(convnet(), model_run_config=cfg, **sim())
    x, y = image_batches(count=1)[0]
    for divisor in (1.0, 2.0, 3.0, 4.0):  # e.g. a per-batch token count
        engine.forward_backward(input_args=(x,), label=y, loss_fn=lambda out, lab: nn.functional.cross_entropy(out, lab) / divisor)
    graphs = whole_graphs(engine)
    assert len(graphs._recorded) == 2 and "loss_fn's closure changed" in graphs.fallback
    other_code = lambda out, lab: nn.functional.cross_entropy(out, lab) * (1 / divisor)  # noqa: E731
    engine.forward_backward(input_args=(x,), label=y, loss_fn=other_code)  # another loss_fn: recorded
    assert len(graphs._recorded) == 3 and graphs.fallback is None
    engine.close()


@pytest.mark.cuda
def test_a_loss_fn_reading_the_gpu_on_the_host_falls_back_on_a_gpu():
    """``.item()`` cannot be recorded: the call runs stage by stage, with the right loss, and says why."""
    engine = RoundPipe(convnet(), model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=SINGLE), **sim(where="cuda"))
    x, y = image_batches(count=1)[0]
    reads = lambda out, lab: nn.functional.cross_entropy(out, lab) * (1.0 if nn.functional.cross_entropy(out, lab).item() < 1e9 else 0.0)  # noqa: E731
    with pytest.warns(UserWarning, match="recording the whole call failed"):
        loss = engine.forward_backward(input_args=(x,), label=y, loss_fn=reads)
    expected = sum(nn.functional.cross_entropy(convnet().cuda()(xm.cuda()), ym.cuda()).item() for xm, ym in zip(x.chunk(2), y.chunk(2)))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert "recording the whole call failed" in engine.explain(x)
    engine.close()


@pytest.mark.cuda
def test_fp16_channels_last_whole_call_matches_the_stage_path_on_a_gpu():
    """The CLI's setting on a small ResNet: fp16 compute, channels-last, GradScaler, async steps, the
    planner's plan; the whole call against the stage path (the same kernels: within 2e-3)."""
    from rptrain.models import build_model

    results = []
    for tuning in (Tuning(), Tuning(whole_call_graphs=False)):
        torch.manual_seed(0)
        model = build_model("resnet18", widths=(8, 16, 32, 64), stem_channels=8, num_classes=10).half()
        engine = RoundPipe(model, memory_format=torch.channels_last, **sim(tuning, "cuda"))
        with OptimizerCtx():
            opt = Adam(engine.parameters(), lr=1e-3)
        scaler = GradScaler()
        for x, y in image_batches(count=5, batch=16):
            engine.forward_backward(input_args=(x.half().cuda(),), label=y.cuda(),
                                    loss_fn=lambda out, lab: scaler.scale(nn.functional.cross_entropy(out.float(), lab)))
            engine.step(lambda: (scaler.step(opt), opt.zero_grad()))
            scaler.update()
        engine.synchronize()
        results.append(engine.state_dict())
        assert bool(engine._executor._whole) == tuning.whole_call_graphs
        engine.close()
    assert_state_close(results[0], results[1], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("where", WHERE)
def test_compiled_stages_train_as_pytorch(where):
    """Tuning(compile_stages=True) (CLI engine.compile): the stage compiled inside the recording (inductor on
    a GPU; on the CPU dynamo with the eager backend, so the tracing of the bound layers is what is
    tested), against plain PyTorch at the fp32 tolerance (2e-4 on a GPU: inductor's fused kernels round apart)."""
    whole, ref = train_both(convnet(), image_batches(count=4), 2, **sim(Tuning(compile_stages=True), where))
    rtol = 2e-4 if where == "cuda" else 1e-5
    assert_state_close(whole.state_dict(), ref.state(), rtol=rtol, atol=rtol)
    graphs = whole_graphs(whole)
    assert graphs._compiled and graphs.fallback is None
    whole.close()

"""A whole call's microbatches run as one batch (engine/fusion.py): which layers allow it and why the
others do not; training through it (a SimulatedDevice, each replay run eagerly; ``cuda``: real graphs)
against the same engine with the microbatches run apart and against plain PyTorch with each
microbatch's BatchNorm statistics (tests/reference.py), fp32 at rtol 1e-5: losses, outputs, weights,
BatchNorm's running statistics and its batch count."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from reference import assert_state_close
from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.engine import fusion
from rptrain.engine.batching import join_cut, merge_outputs
from rptrain.engine.simulated import SimulatedDevice
from rptrain.models import build_model
from rptrain.optim import Adam
from test_engine_equivalence import convnet, image_batches, train_both
from test_engine_whole_call import SINGLE, WHERE, sim, whole_graphs

FUSE = Tuning(fuse_microbatches=True)  # the default
APART = Tuning(fuse_microbatches=False)


class Residual(nn.Module):
    """The tutorial's BasicBlock in miniature: a forward of its own that fx traces."""

    def __init__(self, c: int):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        self.downsample = None

    def forward(self, x):
        out = self.bn(self.conv(x))
        if self.downsample:
            x = self.downsample(x)
        out += x
        return self.relu(out)


class Centered(nn.Module):
    def forward(self, x):
        return x - x.mean(0)  # mixes samples


class Flattened(nn.Module):
    def forward(self, x):
        return x.view(-1)  # a view that could mix samples


class Branching(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x  # fx cannot trace a branch on a tensor's value


class OwnConv(nn.Conv2d):
    def forward(self, x):  # a listed type's subclass with a forward of its own
        return super().forward(x - x.mean(0))


def _hooked(m: nn.Module) -> nn.Module:
    m.register_forward_hook(lambda module, args, out: None)
    return m


def test_the_tutorial_resnet_and_a_traced_block_run_as_one_batch():
    assert fusion.why_not(list(build_model("resnet34"))) is None
    assert fusion.why_not([Residual(4), nn.Flatten(), nn.Softmax(dim=1), nn.Dropout(0.0)]) is None
    assert fusion.why_not([nn.Dropout(0.5).eval()]) is None


@pytest.mark.parametrize("layer, reason", [
    (Centered(), "mean is not known to treat each sample by itself"),
    (Flattened(), "view is not known"),
    (Branching(), "cannot be traced"),
    (OwnConv(3, 3, 1), "mean is not known"),  # traced: its own forward, not the listed type's
    (nn.Dropout(0.5), "dropout would draw its random numbers in another order"),
    (nn.Flatten(0), "flattens from dimension 0"),
    (nn.Softmax(dim=0), "Softmax over dimension 0"),
    (nn.MultiheadAttention(4, 2), "MultiheadAttention is not known"),
    (_hooked(nn.Linear(2, 2)), "a hook on it would see the microbatches together"),
])
def test_layers_that_may_mix_samples_keep_the_microbatches_apart(layer, reason):
    why = fusion.why_not([nn.Identity(), layer])
    assert why is not None and why.startswith(f"layer 1 ({type(layer).__name__})") and reason in why, why


def test_join_and_split_keep_each_microbatch():
    parts = [torch.randn(4, 3), torch.randn(3, 3), torch.randn(3, 3)]
    joined = merge_outputs([(p, 1.5) for p in parts])  # how run_call joins them
    assert joined[0].shape == (10, 3) and joined[1] == 1.5
    assert all(torch.equal(a, b[0]) for a, b in zip(parts, fusion.split(joined, [4, 3, 3])))
    with pytest.raises(ValueError, match="differs between microbatches"):  # the microbatches differ in a number
        merge_outputs([(parts[0], 1.0), (parts[1], 2.0)])
    assert fusion.microbatch_sizes([(p, torch.zeros(len(p))) for p in parts]) == [4, 3, 3]
    assert fusion.microbatch_sizes([(parts[0], torch.zeros(2))]) is None
    with pytest.raises(ValueError, match="no batch dimension of 10"):
        fusion.split(torch.zeros(3), [4, 3, 3])


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_a_stage_by_stage_call_joins_the_callers_batch_without_copying_it(layout):
    """fused_call.py joins the microbatches cut from the caller's batch as that batch's own storage (a pinned
    batch stays pinned for its upload), in either layout; a number that differs keeps them apart."""
    batch = torch.randn(10, 3, 4, 4).contiguous(memory_format=layout)
    parts = [(p, {"scale": 2.0}) for p in batch.split([4, 3, 3])]
    joined, extra = join_cut(parts)
    assert joined.data_ptr() == batch.data_ptr() and joined.stride() == batch.stride() and torch.equal(joined, batch)
    assert extra == {"scale": 2.0}
    apart = [(torch.randn(2, 3), {"scale": 2.0}), (torch.randn(3, 3), {"scale": 2.0})]  # not one tensor's slices: a copy
    assert torch.equal(join_cut(apart)[0], torch.cat([apart[0][0], apart[1][0]]))
    with pytest.raises(ValueError, match="float value differs"):
        join_cut([(batch[:4], 1.0), (batch[4:], 2.0)])


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_forward_without_gradients_runs_its_microbatches_as_one_batch(mode, where):
    """model(x) under no_grad (an evaluation) on one GPU: one batch, the outputs those of the microbatches apart,
    and in training mode BatchNorm's running statistics updated per microbatch, in order, as apart."""
    model, two = convnet(), RoundPipeRunConfig(num_microbatch=2)
    joined = RoundPipe(copy.deepcopy(model), model_run_config=two, **sim(Tuning(), where))
    apart = RoundPipe(copy.deepcopy(model), model_run_config=two, **sim(Tuning(fuse_microbatches=False), where))
    seen, run = [], joined._executor.run
    joined._executor.run = lambda state: (seen.append((state.num_microbatch, state.fused_sizes)), run(state))[1]
    x = image_batches(1)[0][0]
    for engine in (joined, apart):
        getattr(engine, mode)()
    with torch.no_grad():
        out, expected = joined(x), apart(x)
    assert seen == [(1, [4, 4])]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert_state_close({k: v.cpu() for k, v in joined.state_dict().items()}, {k: v.cpu() for k, v in apart.state_dict().items()})
    joined.close(), apart.close()


def test_batch_norm_uses_each_microbatch_statistics_in_order():
    torch.manual_seed(0)
    apart, together = nn.BatchNorm1d(3, momentum=None), nn.BatchNorm1d(3, momentum=None)  # a cumulative average: the order shows
    together.load_state_dict(apart.state_dict())
    parts = [torch.randn(4, 3) * (i + 1) for i in range(3)]
    expected = torch.cat([apart(p) for p in parts])
    with fusion.statistics_per_microbatch([together], [4, 4, 4]):
        got = together(torch.cat(parts))
    assert torch.equal(got, expected)
    assert_state_close(together.state_dict(), apart.state_dict())
    assert "forward" not in vars(together)  # put back


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), Residual(4),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("batch, n", [(8, 2), (10, 3)])  # equal and unequal microbatches
def test_training_with_the_microbatches_as_one_batch_matches_them_apart(batch, n, where):
    batches = image_batches(count=4, batch=batch)
    together, ref = train_both(model(), batches, n, delayed=True, **sim(FUSE, where))  # each step's loss against plain PyTorch
    assert whole_graphs(together).microbatches == "as one batch (fusion.py)"
    assert_state_close(together.state_dict(), ref.state())
    apart, _ = train_both(model(), batches, n, delayed=True, **sim(APART, where))
    assert whole_graphs(apart).microbatches == "apart: off (Tuning.fuse_microbatches=False)"
    assert_state_close(together.state_dict(), apart.state_dict())  # running statistics and batch counts included
    together.close()
    apart.close()


@pytest.mark.parametrize("where", WHERE)
def test_each_microbatch_gets_its_own_loss_and_outputs(where):
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=ExecutePlan.single_stage(7))
    x, y = image_batches(count=1, batch=10)[0]
    got = {}
    for fuse in (True, False):
        engine = RoundPipe(model(), **sim(Tuning(fuse_microbatches=fuse), where))
        for _ in range(3):  # measured, recorded, replayed
            loss, out = engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), return_outputs=True, run_config=cfg)
            engine.synchronize()
        got[fuse] = (loss.clone(), out.clone())
        engine.close()
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-5, atol=1e-6)


def test_a_model_with_dropout_runs_its_microbatches_apart_and_explain_says_why():
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=SINGLE)
    engine = RoundPipe(convnet(dropout=0.5), model_run_config=cfg, **sim(FUSE))
    x, y = image_batches(count=1)[0]
    for _ in range(2):
        engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss())
    why = "apart: layer 6 (Dropout): dropout would draw its random numbers in another order"
    assert whole_graphs(engine).microbatches == why
    assert f"the last recorded call's microbatches: {why}" in engine.explain(x)
    engine.close()


class Caching(nn.Module):
    """Builds a table on first use, as a rotary embedding may."""

    def __init__(self):
        super().__init__()
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.ones(x.shape[1:])
        return x * self.table


def test_tracing_leaves_no_stand_in_behind():
    layer = Caching()
    fusion.why_not([layer])
    assert layer.table is None and vars(layer).keys() == vars(Caching()).keys()
    assert torch.equal(layer(torch.ones(2, 3)), torch.ones(2, 3))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("plan", [None, ExecutePlan.single_stage(7)], ids=["planned", "pinned"])
def test_resume_into_a_fresh_engine_is_exact(plan, where):
    """The engine's defaults. Planned: each engine's first call measures its layers stage by stage with its
    microbatches as one batch (fused_call.py), as the whole calls after it run them; pinned: every call is a
    whole call. Either way the resumed run ends bit for bit where the uninterrupted one does."""
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    batches = image_batches(count=5, batch=10)

    def engine_and_opt():
        engine = RoundPipe(model(), model_run_config=cfg, **sim(Tuning(), where))
        with OptimizerCtx():
            opt = Adam(engine.parameters(), lr=1e-2)
        return engine, opt

    def train(engine, opt, part):
        for x, y in part:
            engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss())
            engine.step(lambda: (opt.step(), opt.zero_grad()))
        engine.synchronize()

    engine, opt = engine_and_opt()
    train(engine, opt, batches[:1])
    if plan is None:
        assert engine._fusion.microbatches == "as one batch (fused_call.py)"  # the measuring call
    train(engine, opt, batches[1:3])
    saved = copy.deepcopy({"model": engine.state_dict(), "optim": opt.state_dict()})
    train(engine, opt, batches[3:])
    resumed, opt2 = engine_and_opt()
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    train(resumed, opt2, batches[3:])
    assert whole_graphs(resumed).microbatches == "as one batch (fusion.py)"
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, engine.state_dict()[k]), k
    engine.close()
    resumed.close()


TWO_STAGES = ExecutePlan.from_cuts(7, forward=[3], backward=[3])


@pytest.mark.parametrize("plan, tuning", [(None, Tuning(whole_call_graphs=False)), (TWO_STAGES, Tuning())],
                         ids=["planned-whole-call-off", "two-stages"])
@pytest.mark.parametrize("batch, n", [(8, 2), (10, 3)])
def test_stage_by_stage_calls_run_as_one_batch_too(plan, tuning, batch, n):
    """Calls that do not take the whole-call path on one GPU run their microbatches as one batch as well
    (BatchNorm per slice, in each stage and in the recomputed forward): plain PyTorch with each
    microbatch's statistics agrees at rtol 1e-5, and so does the same engine with the microbatches apart."""
    batches = image_batches(count=4, batch=batch)
    together, ref = train_both(model(), batches, n, plan=plan, delayed=True, **sim(tuning))
    assert together._fusion.microbatches == "as one batch (fused_call.py)"
    assert "the last stage-by-stage call's microbatches: as one batch (fused_call.py)" in together.explain(batches[0][0])
    assert_state_close(together.state_dict(), ref.state())
    apart, _ = train_both(model(), batches, n, plan=plan, delayed=True, **sim(dataclasses.replace(tuning, fuse_microbatches=False)))
    assert apart._fusion.microbatches == "apart: off (Tuning.fuse_microbatches=False)"
    assert_state_close(together.state_dict(), apart.state_dict())
    together.close()
    apart.close()


def test_a_stage_by_stage_call_gives_each_microbatch_its_losses_and_outputs():
    """Several losses per microbatch, outputs returned: as the microbatches apart give them."""
    cfg = RoundPipeRunConfig(num_microbatch=3, execute_plan=TWO_STAGES)
    x, y = image_batches(count=1, batch=10)[0]

    def two_losses(out, label):
        return [nn.functional.cross_entropy(out, label), out.square().mean()]

    got = {}
    for fuse in (True, False):
        engine = RoundPipe(model(), **sim(Tuning(fuse_microbatches=fuse)))
        losses, out = engine.forward_backward(input_args=(x,), label=y, loss_fn=two_losses, return_outputs=True, run_config=cfg)
        assert engine._fusion.microbatches.startswith("as one batch" if fuse else "apart")
        engine.synchronize()
        got[fuse] = ([t.clone() for t in losses], out.clone(), [p.grad.clone() for p in engine.parameters()])
        engine.close()
    for a, b in zip(got[True][0], got[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[True][2], got[False][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class Scaled(nn.Module):
    def forward(self, x, factor):
        return x * factor


def test_microbatches_whose_other_values_differ_run_apart():
    """A split_input function may hand each microbatch its own number: joining them is not the batch."""
    def split_with_factors(args, kwargs, n):
        return [(part, 1.0 + i) for i, part in enumerate(args[0].split(4))], [{} for _ in range(n)]

    cfg = RoundPipeRunConfig(num_microbatch=2, split_input=split_with_factors, execute_plan=ExecutePlan.from_cuts(2, [1], [1]))
    engine = RoundPipe(nn.Sequential(Scaled(), nn.Linear(3, 2)), **sim())
    x = torch.randn(8, 3)
    loss = engine.forward_backward(input_args=(x, 1.0), label=torch.zeros(8, 2), loss_fn=nn.MSELoss(), run_config=cfg)
    assert engine._fusion.microbatches == "apart: the microbatches' inputs differ in a value that is not a tensor"
    with torch.no_grad():
        linear = engine.model[1]
        expected = sum(nn.MSELoss()(linear(part * (1.0 + i)), torch.zeros(4, 2)) for i, part in enumerate(x.split(4)))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    engine.close()


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.ones(3))

    def forward(self, x):
        return x, self.table  # a tensor of its own beside the batch's


def test_an_output_without_the_batch_dimension_is_one_clear_error():
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=ExecutePlan.from_cuts(2, [1], [1]))
    engine = RoundPipe(nn.Sequential(nn.Linear(3, 3), WithTable()), **sim())
    with pytest.raises(ValueError, match=r"ran as one batch, but a stage output of shape \(3,\) has no batch dimension of 8 to cut; "
                                         r"RoundPipe\(\.\.\., tuning=Tuning\(fuse_microbatches=False\)\) runs them apart"):
        engine.forward_backward(input_args=(torch.randn(8, 3),), label=torch.zeros(8, 3), loss_fn=lambda out, y: (out[0] - y).square().mean(),
                                run_config=cfg)
    engine.close()


def test_several_devices_keep_their_microbatches_apart():
    engine = RoundPipe(model(), devices=[SimulatedDevice(0), SimulatedDevice(1)], tuning=Tuning())
    x, y = image_batches(count=1, batch=8)[0]
    engine.forward_backward(input_args=(x,), label=y, loss_fn=nn.CrossEntropyLoss(), run_config=RoundPipeRunConfig(num_microbatch=2))
    assert engine._fusion.microbatches == "apart: 2 GPUs: their microbatches are the pipeline's parallelism"
    engine.close()


def test_only_the_batch_cut_along_its_first_dimension_is_joined():
    """A tensor handed whole to every microbatch (its first dimension merely equal to a microbatch's) or
    cut by a split_input function along another dimension must not be concatenated."""
    x, table = torch.randn(8, 3), torch.randn(4, 3)
    assert fusion.cut_along_batch([(part,) for part in x.split([4, 4])])
    assert not fusion.cut_along_batch([(part, table) for part in x.split([4, 4])])  # the same table in both
    assert not fusion.cut_along_batch([(part,) for part in x.split([2, 1], dim=1)])
    assert not fusion.cut_along_batch([(part,) for part in reversed(x.split([4, 4]))])


class AddTable(nn.Module):
    def forward(self, x, table):
        return x + table


@pytest.mark.parametrize("where", WHERE)
def test_a_tensor_handed_to_every_microbatch_keeps_them_apart(where):
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=ExecutePlan.single_stage(2))
    engine = RoundPipe(nn.Sequential(AddTable(), nn.Linear(3, 2)), **sim(FUSE, where))
    x, table = torch.randn(8, 3), torch.randn(4, 3)  # a table of 4 rows: a microbatch's size, not the batch's
    for _ in range(2):
        loss = engine.forward_backward(input_args=(x, table), label=torch.zeros(8, 2), loss_fn=nn.MSELoss(), run_config=cfg)
    assert whole_graphs(engine).microbatches == "apart: the microbatches' inputs are not the batch cut along its first dimension"
    with torch.no_grad():
        model = engine.model
        expected = sum(nn.MSELoss()(model[1](part + table), torch.zeros(4, 2)) for part in x.split(4))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    engine.close()

"""GradScaler: same numbers as torch.amp.GradScaler when used plainly, and correct when the step
runs one iteration late on the optimizer thread (each step unscales by its own iteration's scale)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from reference import DEVICE, ran_as_one_batch, split
from rptrain import ExecutePlan, GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.optim import Adam


def model16() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).half()


def batches(count: int = 6, blow_up_at: int = 2):
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(count):
        x = torch.randn(8, 8, generator=g)
        if i == blow_up_at:
            x = x * 3e4  # fp16 activations overflow: this iteration's gradients hold inf
        out.append((x.half(), torch.randint(0, 4, (8,), generator=g)))
    return out


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)


class ScaledReference:
    """fp16 compute copy, fp32 master, loss scaling by hand, optionally one step stale."""

    def __init__(self, model, delayed, init_scale, growth_interval):
        self.compute, self.master = copy.deepcopy(model).to(DEVICE), copy.deepcopy(model).float()
        self.opt = torch.optim.Adam(self.master.parameters(), lr=1e-2)
        self.delayed = delayed
        self.scale, self.tracker, self.interval = init_scale, 0, growth_interval
        self.scales_used = []

    def iteration(self, x, y, n, clip=None, fused=False):
        """``fused``: the microbatches as one batch, each its loss on its slice, one backward (engine/fused_call.py)."""
        scale = self.scale
        self.scales_used.append(scale)
        if fused:
            out = self.compute(x.to(DEVICE))
            torch.autograd.backward([loss_fn(o, ym) * scale for o, ym in zip(split(out, n), split(y.to(DEVICE), n))])
        else:
            for xm, ym in zip(split(x.to(DEVICE), n), split(y.to(DEVICE), n)):
                (loss_fn(self.compute(xm), ym) * scale).backward()
        grads = []
        for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
            pm.grad = pc.grad.float().cpu()
            pc.grad = None
            grads.append(pm.grad)
        found_inf = any(not torch.isfinite(g).all() for g in grads)
        previous = [p.detach().clone() for p in self.master.parameters()]
        if not found_inf:
            for g in grads:
                g.div_(scale)
            if clip is not None:
                nn.utils.clip_grad_norm_(self.master.parameters(), clip)
            self.opt.step()
        self.opt.zero_grad()
        if found_inf:
            self.scale, self.tracker = self.scale * 0.5, 0
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                self.scale, self.tracker = self.scale * 2.0, 0
        source = previous if self.delayed else [p.detach() for p in self.master.parameters()]
        with torch.no_grad():
            for pc, value in zip(self.compute.parameters(), source):
                pc.copy_(value)
        return found_inf


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("thread", ["inline", "thread"])
def test_engine_scaler_matches_hand_written_reference(is_async, clip, thread):
    engine = RoundPipe(model16(), tuning=Tuning(cpu_optimizer_thread=thread == "thread"))
    train_scaled_against_reference(engine, is_async, clip)
    engine.close()


def train_scaled_against_reference(engine: RoundPipe, is_async: bool, clip=None) -> None:
    """Train ``engine`` (over model16()) with a GradScaler through an overflowing iteration, against
    ScaledReference: the same steps skipped, masters within 2e-3, the same final scale."""
    init_scale, interval = 2.0**10, 1  # the scale changes every step, so a stale unscale would show
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=init_scale, growth_interval=interval)
    ref = ScaledReference(model16(), is_async, init_scale, interval)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=ExecutePlan.from_cuts(5, [2], [2]))

    def step():
        if clip is not None:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        scaler.step(opt)
        opt.zero_grad()

    skipped = []
    for x, y in batches():
        assert scaler.get_scale() == ref.scale
        engine.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(loss_fn(o, t)), run_config=cfg)
        engine.step(step, is_async=is_async)
        scaler.update()
        skipped.append(ref.iteration(x, y, 2, clip=clip, fused=ran_as_one_batch(engine)))  # one GPU: the reference joins them as well
    assert skipped[2] and not any(skipped[:2])
    engine.synchronize()
    state = engine.state_dict()
    for name, p in ref.master.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=2e-3, atol=2e-3)
    assert scaler.get_scale() == ref.scale


def test_plain_use_matches_torch_amp_grad_scaler():
    torch.manual_seed(0)
    ours_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    theirs_model = copy.deepcopy(ours_model)
    ours_opt = torch.optim.Adam(ours_model.parameters(), lr=1e-2)
    theirs_opt = torch.optim.Adam(theirs_model.parameters(), lr=1e-2)
    ours, theirs = GradScaler(init_scale=256.0, growth_interval=2), torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        x = torch.randn(4, 4, generator=g)
        y = torch.randn(4, 2, generator=g)
        for model, opt, scaler in ((ours_model, ours_opt, ours), (theirs_model, theirs_opt, theirs)):
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if i == 3:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert ours.get_scale() == theirs.get_scale()
    for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
        torch.testing.assert_close(a, b)


def test_state_dict_round_trip_and_validation():
    scaler = GradScaler(init_scale=8.0, growth_interval=3)
    scaler._observe(False)
    scaler.update()
    other = GradScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.get_scale() == 8.0 and other.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="missing keys"):
        other.load_state_dict({"scale": 1.0})
    with pytest.raises(ValueError, match="init_scale"):
        GradScaler(init_scale=-1)
    with pytest.raises(ValueError, match="growth_interval"):
        GradScaler(growth_interval=0)


def test_disabled_scaler_is_transparent():
    scaler = GradScaler(enabled=False)
    t = torch.tensor(3.0)
    assert scaler.scale(t) is t and scaler.get_scale() == 1.0
    scaler.update()
    assert scaler.state_dict() == {}


def test_update_without_checks_is_an_error():
    with pytest.raises(RuntimeError, match="no inf checks"):
        GradScaler().update()

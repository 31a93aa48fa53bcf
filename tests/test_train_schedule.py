"""The LR schedule: linear warmup, then constant or cosine decay, stepped like the trainer does."""
from __future__ import annotations

import math

import pytest
import torch

from rptrain.train.schedule import lr_factor, warmup_cosine


def test_constant_without_warmup_is_the_tutorials_fixed_lr():
    f = lr_factor(0, "constant", 100, 0.0)
    assert [f(s) for s in (0, 1, 50, 1000)] == [1.0] * 4


def test_warmup_then_cosine_to_the_floor():
    f = lr_factor(warmup_steps=4, decay="cosine", decay_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))


def test_lambda_lr_follows_the_factor_when_stepped_after_each_optimizer_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = warmup_cosine(opt, total_steps=10, warmup_steps=2, decay="cosine")
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    f = lr_factor(2, "cosine", 10, 0.0)
    assert seen == pytest.approx([0.5 * f(s) for s in range(10)])
    # A closure is not saved; the schedule is rebuilt from the config and gets its position back.
    state = sched.state_dict()
    fresh = warmup_cosine(torch.optim.SGD([p], lr=0.5), total_steps=10, warmup_steps=2, decay="cosine")
    fresh.load_state_dict(state)
    assert fresh.last_epoch == 10

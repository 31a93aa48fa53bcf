"""A failed step leaves the weights exactly as before it, or, where it had already written part of the
master or of an optimizer's state (a mix no later step can undo), the engine says so and refuses to go
on until whole weights are loaded (engine/step_guard.py). Synchronous and asynchronous steps, the step
run inline and on the optimizer thread: the same calls fail and the same weights result either way."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rptrain import OptimizerCtx, RoundPipe, Tuning
from rptrain.optim import Adam

X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 2
CE = nn.CrossEntropyLoss()
MODES = [(a, t) for a in (False, True) for t in (False, True)]
IDS = [f"{'async' if a else 'sync'}-{'thread' if t else 'inline'}" for a, t in MODES]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def engine_and_opt(thread: bool, optimizer=Adam):
    engine = RoundPipe(mlp(), tuning=Tuning(cpu_optimizer_thread=thread))
    with OptimizerCtx():
        opt = optimizer(engine.parameters(), lr=1e-2)
    return engine, opt


def train(engine, opt, steps: int, is_async: bool) -> None:
    for _ in range(steps):
        engine.forward_backward((X,), label=Y, loss_fn=CE)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)


def failing_calls(engine, step_fn, is_async: bool) -> None:
    """A step and the calls up to the one that waits for it: a synchronous step reports its own error;
    after an asynchronous one the next call still uses the version before it, synchronize() waits."""
    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.step(step_fn, is_async=is_async)
    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.synchronize()


def fail_at_wait(engine, step_fn, is_async: bool) -> RuntimeError:
    with pytest.raises(RuntimeError) as err:
        failing_calls(engine, step_fn, is_async)
    return err.value


@pytest.mark.parametrize("is_async, thread", MODES, ids=IDS)
def test_a_step_failing_before_any_write_leaves_the_weights_and_training_as_without_it(is_async, thread):
    engine, opt = engine_and_opt(thread)
    train(engine, opt, 2, is_async)
    engine.synchronize()
    before = engine.state_dict()

    def clip_fails():  # what fails first in a real step function: checks, clipping, a bad closure
        raise ValueError("clip_grad_norm_: bad max_norm")

    err = fail_at_wait(engine, clip_fails, is_async)
    assert "bad max_norm" in str(err) and "mix" not in str(err)
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    train(engine, opt, 2, is_async)
    engine.synchronize()
    result = engine.state_dict()
    engine.close()

    ref, ref_opt = engine_and_opt(thread)  # the same run without the failed step
    train(ref, ref_opt, 2, is_async)
    ref.synchronize()
    if is_async:  # the same calls, a step that does nothing in place of the failed one (its gradients stay bound)
        failing_calls(ref, lambda: None, is_async)
    else:
        ref.forward_backward((X,), label=Y, loss_fn=CE)
        ref.step(lambda: None, is_async=is_async)
    train(ref, ref_opt, 2, is_async)
    ref.synchronize()
    expected = ref.state_dict()
    ref.close()
    assert all(torch.equal(result[k], expected[k]) for k in expected)


@pytest.mark.parametrize("is_async, thread", MODES, ids=IDS)
def test_a_step_failing_after_writing_part_of_the_master_is_reported_and_refused_until_loaded(is_async, thread):
    engine, opt = engine_and_opt(thread)
    train(engine, opt, 2, is_async)
    engine.synchronize()
    whole = engine.state_dict()
    params = list(engine.optim_parameters())

    def half_written():  # a kernel failing halfway through the parameters
        with torch.no_grad():
            params[0].add_(1.0)
        raise RuntimeError("kernel failed on parameter 2")

    err = fail_at_wait(engine, half_written, is_async)
    assert "kernel failed on parameter 2" in str(err) and "master weights" in str(err) and "load_state_dict" in str(err)
    for call in (lambda: engine.forward_backward((X,), label=Y, loss_fn=CE), lambda: engine.step(lambda: None),
                 engine.synchronize, engine.state_dict, lambda: engine(X)):
        with pytest.raises(RuntimeError, match="mix of two versions"):
            call()
    engine.load_state_dict(whole)
    assert all(torch.equal(whole[k], v) for k, v in engine.state_dict().items())
    train(engine, opt, 1, is_async)  # trains again
    engine.close()


class HalfwayOptimizer(torch.optim.Optimizer):
    """Writes its state for the first parameter, then fails: no master weight changed yet."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        first = self.param_groups[0]["params"][0]
        self.state[first].setdefault("momentum", torch.zeros_like(first)).add_(first.grad)
        raise RuntimeError("optimizer failed after one parameter's state")


@pytest.mark.parametrize("is_async, thread", MODES, ids=IDS)
def test_an_optimizer_failing_after_writing_part_of_its_state_is_reported(is_async, thread):
    engine, opt = engine_and_opt(thread, optimizer=HalfwayOptimizer)
    err = fail_at_wait(engine, opt.step, is_async)
    assert "after one parameter's state" in str(err) and "the state of 1 optimizer(s)" in str(err)
    with pytest.raises(RuntimeError, match="mix of two versions"):
        engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.close()


def test_the_failure_is_reported_by_the_same_call_whichever_finishes_first():
    """On the thread the step may end before or after the next call starts: the refusal starts at the
    call that waits for it, as inline, so the same calls run and the weights are the same."""
    results = []
    for thread in (False, True):
        engine, opt = engine_and_opt(thread)
        train(engine, opt, 1, True)
        params = list(engine.optim_parameters())

        def half_written():
            with torch.no_grad():
                params[-1].mul_(2.0)
            raise RuntimeError("boom")

        engine.forward_backward((X,), label=Y, loss_fn=CE)
        engine.step(half_written, is_async=True)
        loss = engine.forward_backward((X,), label=Y, loss_fn=CE)  # the version before: runs
        engine.step(lambda: None, is_async=True)  # submitted behind the failed one
        with pytest.raises(RuntimeError, match="boom.*mix of two versions"):
            engine.forward_backward((X,), label=Y, loss_fn=CE)  # waits for the failed step's version
        results.append(float(loss))
        engine.close()
    assert results[0] == results[1]


@pytest.mark.parametrize("is_async, thread", MODES, ids=IDS)
def test_engine_calls_from_inside_a_step_function_are_refused(is_async, thread):
    """A nested step applied the bound gradients a second time; a nested call that waits for steps
    would wait for itself. Each is the step's error, the weights are as before, training goes on."""
    engine, opt = engine_and_opt(thread)
    train(engine, opt, 1, is_async)
    engine.synchronize()
    before = engine.state_dict()
    for nested in (lambda: engine.step(opt.step), lambda: engine.forward_backward((X,), label=Y, loss_fn=CE),
                   engine.state_dict, engine.synchronize):
        err = fail_at_wait(engine, nested, is_async)
        assert "from inside a step function" in str(err)
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    train(engine, opt, 1, is_async)
    engine.close()

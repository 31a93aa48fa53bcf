"""Bad input gets a clear error; failures in worker and optimizer threads reach the caller."""
from __future__ import annotations

import subprocess
import threading
import sys

import pytest
import torch
from torch import nn

from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning
from rptrain.optim import Adam


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def engine_and_opt(**kw):
    engine = RoundPipe(mlp(), **kw)
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    return engine, opt


X, Y = torch.randn(4, 4), torch.randint(0, 2, (4,))
CE = nn.CrossEntropyLoss()


def test_importing_starts_no_threads_and_touches_no_gpu():
    code = (
        "import threading, torch, rptrain, rptrain.optim;"
        "assert threading.active_count() == 1, threading.enumerate();"
        "assert not torch.cuda.is_initialized();"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_model_must_be_a_module_and_a_sequential_nonempty():
    with pytest.raises(TypeError, match="nn.Module"):
        RoundPipe(lambda x: x)
    with pytest.raises(ValueError, match="non-empty"):
        RoundPipe(nn.Sequential())
    with pytest.raises(TypeError, match="optim_dtype"):
        RoundPipe(mlp(), optim_dtype=torch.int32)
    with pytest.raises(TypeError, match="model_run_config"):
        RoundPipe(mlp(), model_run_config={"num_microbatch": 2})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_microbatch": 0}, r"num_microbatch must be an integer >= 1"),
        ({"num_microbatch": 2.5}, r"num_microbatch must be an integer >= 1"),
        ({"recompute_grain": "block"}, r"recompute_grain must be one of"),
        ({"requires_grad": "yes"}, r"requires_grad must be True, False or None"),
        ({"output_device": "gpu9"}, r"output_device must name a torch device"),
        ({"split_input": 3}, r"split_input must be callable or \(args_spec, kwargs_spec\)"),
        ({"execute_plan": [[0, 3]]}, r"execute_plan must be an ExecutePlan"),
    ],
)
def test_run_config_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoundPipeRunConfig(**kwargs)


def test_plan_validation():
    with pytest.raises(ValueError, match="contiguous"):
        ExecutePlan(forward=((0, 2), (3, 4)), backward=((0, 2), (3, 4)))
    with pytest.raises(ValueError, match="must be the same"):
        ExecutePlan.from_cuts(4, [2], [3])
    engine, _ = engine_and_opt()
    with pytest.raises(ValueError, match="covers 5 layers but the model has 3"):
        engine.forward_backward((X,), label=Y, loss_fn=CE, run_config=RoundPipeRunConfig(execute_plan=ExecutePlan.single_stage(5)))


def test_bad_call_arguments():
    engine, _ = engine_and_opt()
    with pytest.raises(TypeError, match="input_args must be a tuple"):
        engine.forward_backward(input_args=5, label=Y, loss_fn=CE)
    with pytest.raises(TypeError, match="input_kwargs must be a dict"):
        engine.forward_backward(input_args=(X,), input_kwargs=[1], label=Y, loss_fn=CE)
    with pytest.raises(TypeError, match="loss_fn"):
        engine.forward_backward(input_args=(X,), label=Y, loss_fn=None)
    with pytest.raises(ValueError, match="no input tensors"):
        engine.forward_backward(input_args=(), label=Y, loss_fn=CE)
    with pytest.raises(ValueError, match="empty"):
        engine.forward_backward(input_args=(torch.empty(0, 4),), label=torch.empty(0, dtype=torch.long), loss_fn=CE)
    with pytest.raises(ValueError, match=r"num_microbatch=5 is larger than the batch size 4"):
        engine.forward_backward(input_args=(X,), label=Y, loss_fn=CE, run_config=RoundPipeRunConfig(num_microbatch=5))
    with pytest.raises(TypeError, match="step\\(\\) needs a callable"):
        engine.step(None)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        engine.forward_backward(input_args=(X,), label=Y, loss_fn=lambda o, y: o)
    with pytest.raises(RuntimeError, match="decides where weights live"):
        engine.cuda() if torch.cuda.is_available() else engine.half()


def test_layer_error_propagates_and_engine_stays_usable():
    class Boom(nn.Module):
        armed = True

        def forward(self, x):
            if Boom.armed:
                raise ArithmeticError("boom in layer")
            return x

    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 8), Boom(), nn.Linear(8, 2)))
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    plan = RoundPipeRunConfig(execute_plan=ExecutePlan.per_layer(3))
    with pytest.raises(ArithmeticError, match="boom in layer") as info:
        engine.forward_backward((X,), label=Y, loss_fn=CE, run_config=plan)
    assert "boom" in "".join(__import__("traceback").format_exception(info.value))
    Boom.armed = False
    loss = engine.forward_backward((X,), label=Y, loss_fn=CE, run_config=plan)
    engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    assert torch.isfinite(loss)


def test_error_on_one_of_several_devices_does_not_hang():
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("device two failed")

    engine = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Boom(), nn.Linear(4, 2)), devices=["cpu", "cpu", "cpu"])
    cfg = RoundPipeRunConfig(num_microbatch=4, execute_plan=ExecutePlan.per_layer(4))
    with pytest.raises(KeyError, match="device two failed"):
        engine.forward_backward((X,), label=Y, loss_fn=CE, run_config=cfg)


@pytest.mark.parametrize("thread", ["inline", "thread"])
def test_optimizer_thread_error_reaches_the_caller_once(thread):
    engine, opt = engine_and_opt(tuning=Tuning(cpu_optimizer_thread=thread == "thread"))

    def bad_step():
        raise OSError("disk full in step")

    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.step(bad_step)  # asynchronous: the error surfaces at the next call
    with pytest.raises(RuntimeError, match="optimizer step failed.*disk full") as info:
        engine.synchronize()
    assert isinstance(info.value.__cause__, OSError)
    # It was reported; the engine goes on.
    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    engine.synchronize()


def _alive(name: str) -> bool:
    import threading

    return any(t.name == name and t.is_alive() for t in threading.enumerate())


@pytest.fixture
def threaded():
    """CPU engines run steps inline unless asked for the thread: here the thread is the subject."""
    return Tuning(cpu_optimizer_thread=True)


def test_close_stops_the_optimizer_thread(threaded):
    engine, opt = engine_and_opt(tuning=threaded)
    name = f"rptrain-optimizer-{id(engine):x}"
    assert not _alive(name)  # started on first use only
    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.step(lambda: (opt.step(), opt.zero_grad()))
    assert _alive(name)
    engine.close()
    assert not _alive(name)


def test_garbage_collected_engine_stops_its_thread(threaded):
    import gc
    import time

    engine, opt = engine_and_opt(tuning=threaded)
    name = f"rptrain-optimizer-{id(engine):x}"
    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    assert _alive(name)
    del engine, opt
    gc.collect()
    deadline = time.time() + 10
    while _alive(name) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(name)


def test_optimizer_threads_apply_to_the_optimizer_thread_only(threaded):
    before = torch.get_num_threads()
    engine, opt = engine_and_opt(optimizer_threads=1, tuning=threaded)
    seen = []
    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.step(lambda: (seen.append(torch.get_num_threads()), opt.step(), opt.zero_grad()), is_async=False)
    assert seen == [1]
    assert torch.get_num_threads() == before
    engine.close()
    for bad in (0, -2, 1.5, "4"):
        with pytest.raises(ValueError, match="optimizer_threads"):
            RoundPipe(mlp(), optimizer_threads=bad)


@pytest.mark.parametrize("thread", ["inline", "thread"])
def test_failed_synchronous_step_does_not_block_the_next_call(thread):
    """The failed step left the master .grad pointing into the gradient buffer; the next call
    must still get a buffer (it used to wait for it forever)."""
    engine, opt = engine_and_opt(tuning=Tuning(cpu_optimizer_thread=thread == "thread"))

    def bad_step():
        raise OSError("step failed after the gradients were bound")

    engine.forward_backward((X,), label=Y, loss_fn=CE)
    with pytest.raises(RuntimeError, match="step failed after"):
        engine.step(bad_step, is_async=False)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("loss", engine.forward_backward((X,), label=Y, loss_fn=CE)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "forward_backward blocked after a failed synchronous step"
    assert torch.isfinite(result["loss"])
    engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    engine.close()


@pytest.mark.parametrize("thread", ["inline", "thread"])
def test_close_reports_an_unreported_step_error(thread):
    engine, _ = engine_and_opt(tuning=Tuning(cpu_optimizer_thread=thread == "thread"))
    engine.forward_backward((X,), label=Y, loss_fn=CE)
    engine.step(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="optimizer step failed.*division by zero"):
        engine.close()
    assert not _alive(f"rptrain-optimizer-{id(engine):x}")  # closed all the same
    engine.close()  # reported once: a second close is quiet

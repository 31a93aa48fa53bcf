"""The engine's API misused, from a user's program: every fault ends in one exception naming the
problem (never a hang, never a silent success), and afterwards the weights are either exactly
those before the faulty call or refused until whole ones are loaded (engine/step_guard.py)."""
from __future__ import annotations

import random
import threading
from typing import Any, Callable

import torch
from torch import nn

from rptrain import OptimizerCtx, RoundPipe, Tuning
from rptrain.optim import Adam

from . import outcome as o

X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 2
CE = nn.CrossEntropyLoss()
HANG_S = 60.0
ACCEPTED_AS_TORCH_DOES = {"load_other_dtype"}  # nn.Module.load_state_dict casts too: the values are the same


def _engine(thread: bool):
    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), tuning=Tuning(cpu_optimizer_thread=thread))
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    return engine, opt


def _fb(engine, *args, **kwargs):
    return engine.forward_backward(*(args or ((X,),)), **({"label": Y, "loss_fn": CE} | kwargs))


def _half_written(engine):
    params = list(engine.optim_parameters())

    def step():
        with torch.no_grad():
            params[0].add_(1.0)
        raise RuntimeError("failed halfway")
    return step


# name: the faulty calls given (engine, opt, is_async)
CASES: dict[str, Callable[[Any, Any, bool], Any]] = {
    "call_after_close": lambda e, opt, a: (e.close(), _fb(e)),
    "step_after_close": lambda e, opt, a: (e.close(), e.step(opt.step)),
    "step_not_callable": lambda e, opt, a: e.step(42, is_async=a),
    "step_fn_raises_first": lambda e, opt, a: (_fb(e), e.step(lambda: 1 / 0, is_async=a), _fb(e), e.synchronize()),
    "step_fn_raises_halfway": lambda e, opt, a: (_fb(e), e.step(_half_written(e), is_async=a), _fb(e), e.synchronize()),
    "keyboard_interrupt_in_step": lambda e, opt, a: (_fb(e), e.step(_raise(KeyboardInterrupt), is_async=a), _fb(e), e.synchronize()),
    "loss_fn_raises": lambda e, opt, a: _fb(e, loss_fn=lambda out, y: 1 / 0),
    "loss_not_a_tensor": lambda e, opt, a: _fb(e, loss_fn=lambda out, y: "loss"),
    "input_wrong_shape": lambda e, opt, a: _fb(e, (torch.randn(8, 5),)),
    "input_wrong_dtype": lambda e, opt, a: _fb(e, (torch.randint(0, 3, (8, 4)),)),
    "input_not_a_tensor": lambda e, opt, a: _fb(e, ("text",)),
    "label_wrong_length": lambda e, opt, a: _fb(e, label=Y[:3]),
    "load_wrong_shape": lambda e, opt, a: e.load_state_dict({k: torch.zeros(3) for k in e.state_dict()}),
    "load_missing_keys": lambda e, opt, a: e.load_state_dict({}),
    "load_not_a_dict": lambda e, opt, a: e.load_state_dict([1, 2]),
    "load_other_dtype": lambda e, opt, a: e.load_state_dict({k: v.double() for k, v in e.state_dict().items()}),
    "num_microbatch_zero": lambda e, opt, a: _fb(e, run_config=_bad_run_config()),
    "explain_bad_input": lambda e, opt, a: e.explain("not a tensor"),
    "step_in_step": lambda e, opt, a: (_fb(e), e.step(lambda: e.step(opt.step), is_async=a), e.synchronize()),
    "forward_in_step": lambda e, opt, a: (_fb(e), e.step(lambda: _fb(e), is_async=a), e.synchronize()),
}


def _raise(kind):
    def fn():
        raise kind()
    return fn


def _bad_run_config():
    from rptrain import RoundPipeRunConfig

    return RoundPipeRunConfig(num_microbatch=0)


def _run(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", result) / ("raised", exception) / ("hang", None) with a time limit (a daemon thread)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - the fault under test
            box["raised"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():
        return "hang", None
    return ("raised", box["raised"]) if "raised" in box else ("ok", box.get("ok"))


def engine_trial(index: int, rng: random.Random) -> o.Trial:
    name = sorted(CASES)[index % len(CASES)]
    is_async, thread = rng.random() < 0.5, rng.random() < 0.5
    detail: dict[str, Any] = {"async": is_async, "thread": thread}
    engine, opt = _engine(thread)
    _fb(engine)
    engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    before = engine.state_dict()
    how, value = _run(lambda: CASES[name](engine, opt, is_async))
    detail["how"] = how
    if how == "hang":
        return o.Trial("engine_api", name, o.HANG, detail)
    if how == "ok":
        return o.Trial("engine_api", name, "completed" if name in ACCEPTED_AS_TORCH_DOES else o.ACCEPTED, detail)
    detail["error"] = f"{type(value).__name__}: {value}"[:240]
    if not isinstance(value, (TypeError, ValueError, KeyError, RuntimeError, KeyboardInterrupt, ZeroDivisionError)):
        return o.Trial("engine_api", name, o.BAD_END, detail)
    how, after = _run(engine.state_dict)
    if how == "hang":
        return o.Trial("engine_api", name, o.HANG, detail)
    if how == "raised":  # closed, or refused until whole weights are loaded
        if "mix of two versions" not in str(after) and "closed" not in str(after):
            detail["state_dict_error"] = str(after)[:240]
            return o.Trial("engine_api", name, o.BAD_END, detail)
        return o.Trial("engine_api", name, "refused_after" if "mix" in str(after) else "refused", detail)
    if any(not torch.equal(before[k], after[k]) for k in before):
        return o.Trial("engine_api", name, o.LOST, detail)  # weights changed by a call that failed
    how, _ = _run(lambda: (_fb(engine), engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False), engine.close()))
    if how != "ok":
        detail["then"] = how
        return o.Trial("engine_api", name, o.HANG if how == "hang" else o.BAD_END, detail)
    return o.Trial("engine_api", name, "refused", detail)

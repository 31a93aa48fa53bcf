"""Shared by the tests/test_optim_<family>.py files: parameters laid out as the engine lays them out,
and one comparison of an rptrain optimizer with torch's own implementation of the same name."""
from __future__ import annotations

import copy

import torch

from rptrain.engine.layout import ALIGN_BYTES

# Shapes of a small network: a matrix, a bias, a convolution kernel (the engine may store it channels-last), norms.
SHAPES = [(6, 5), (6,), (4, 3, 3, 3), (4,), (4,), (2, 4)]


def flat_params(shapes=SHAPES, seed: int = 0, channels_last: bool = False) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    """Parameters and gradients as views of two flat buffers, each tensor starting on a 256-byte boundary
    (zero padding between), the way the engine hands them over."""
    step = ALIGN_BYTES // 4
    offsets, end = [], 0
    for s in shapes:
        offsets.append(end)
        end = -(-(end + torch.Size(s).numel()) // step) * step
    g = torch.Generator().manual_seed(seed)
    data, grads = torch.zeros(end), torch.zeros(end)
    params = []
    for s, offset in zip(shapes, offsets):
        n = torch.Size(s).numel()
        data[offset : offset + n] = torch.randn(n, generator=g)
        if channels_last and len(s) == 4:
            n_, c, h, w = s
            view = lambda flat: flat[offset : offset + n].view(n_, h, w, c).permute(0, 3, 1, 2)
        else:
            view = lambda flat: flat[offset : offset + n].view(s)
        p = torch.nn.Parameter(view(data))
        p.grad = view(grads)
        params.append(p)
    return params, grads


def new_grads(params, grads: torch.Tensor, generator: torch.Generator) -> None:
    """Fill every parameter's gradient (in the flat buffer) with fresh values; padding stays zero."""
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=generator))


def groups_of(params, split: bool, **second) -> list:
    """One group, or two interleaved in memory with ``second`` overriding options in the second."""
    if not split:
        return [{"params": params}]
    return [{"params": params[0::2]}, {"params": params[1::2], **second}]


def compare_with_torch(cls, ref_cls, kwargs: dict, split: bool = False, second: dict | None = None, steps: int = 4,
                       rtol: float = 1e-5, atol: float = 1e-6, channels_last: bool = False, ref_kwargs: dict | None = None):
    """Step ours on engine-like flat parameters and torch's default implementation on separate copies,
    with the same gradients; compare parameters and every state tensor after each step."""
    params, grads = flat_params(channels_last=channels_last)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = cls(groups_of(params, split, **(second or {})), **kwargs)
    theirs = ref_cls(groups_of(ref, split, **(second or {})), **{**kwargs, **(ref_kwargs or {})})
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        new_grads(params, grads, g)
        for p, r in zip(params, ref):
            r.grad = p.grad.clone()
        ours.step()
        theirs.step()
        for i, (p, r) in enumerate(zip(params, ref)):
            torch.testing.assert_close(p, r, rtol=rtol, atol=atol, msg=lambda m: f"param {i}: {m}")
            assert set(ours.state[p]) == set(theirs.state[r]), (set(ours.state[p]), set(theirs.state[r]))
            for name, value in theirs.state[r].items():
                torch.testing.assert_close(torch.as_tensor(ours.state[p][name]).float(), torch.as_tensor(value).float(),
                                           rtol=rtol, atol=atol, msg=lambda m: f"state {name} of param {i}: {m}")
    return ours, theirs, params


def round_trip(cls, kwargs: dict, steps: int = 2) -> None:
    """save -> load into a fresh optimizer on fresh flat parameters -> both continue identically."""
    params, grads = flat_params()
    opt = cls(params, **kwargs)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        new_grads(params, grads, g)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin_params, twin_grads = flat_params()
    with torch.no_grad():
        for a, b in zip(twin_params, params):
            a.copy_(b)
    twin = cls(twin_params, **kwargs)
    twin.load_state_dict(saved)
    for _ in range(steps):
        new_grads(params, grads, g)
        for a, b in zip(twin_params, params):
            a.grad.copy_(b.grad)
        opt.step()
        twin.step()
    for a, b in zip(twin_params, params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    loaded = twin.state_dict()["state"]
    for index, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(torch.as_tensor(loaded[index][name]), torch.as_tensor(value), rtol=0, atol=0)


def assert_flat(opt, params) -> None:
    """The flat path ran: adjacent parameters' state tensors are views of one buffer."""
    a, b = opt.state[params[0]], opt.state[params[1]]
    shared = [n for n, t in a.items() if t.dim() > 0 and n in b
              and t.untyped_storage().data_ptr() == b[n].untyped_storage().data_ptr()]
    assert shared, f"no flat state in {sorted(a)}"


def assert_specs_describe_state(opt) -> None:
    """``state_specs`` names every state tensor torch's optimizer keeps, with its size and dtype."""
    for group in opt.param_groups:
        for p in group["params"]:
            specs = type(opt).state_specs(group, p.shape)
            state = opt.state[p]
            assert {s.name for s in specs} == set(state), (sorted(s.name for s in specs), sorted(state))
            for spec in specs:
                t = torch.as_tensor(state[spec.name])
                assert spec.bytes(p.shape, p.dtype) == t.numel() * t.element_size(), spec


def engine_matches_torch(cls, ref_cls, kwargs: dict, steps: int = 3, simulated: bool = False) -> None:
    """Through the engine (master weights in its flat buffers, stepped on its optimizer thread) the
    optimizer gives the weights torch's optimizer gives a plain model. ``simulated``: the engine on a
    SimulatedDevice, its GPU paths (resident weights, the training state's GPU placement) on the CPU."""
    from rptrain.engine.simulated import SimulatedDevice

    from rptrain import OptimizerCtx, RoundPipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    engine = RoundPipe(copy.deepcopy(model), devices=[SimulatedDevice(0)] if simulated else ["cpu"])
    with OptimizerCtx():
        opt = cls(engine.parameters(), **kwargs)
    ref_opt = ref_cls(model.parameters(), **kwargs)
    x = torch.randn(3, 4)
    for _ in range(steps):
        engine.forward_backward((x,), loss_fn=lambda out, _: out.pow(2).sum())
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        model(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    engine.synchronize()
    for name, p in model.named_parameters():
        torch.testing.assert_close(engine.state_dict()[name], p.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


def compiled_matches_torch(cases: dict, per_run: bool = True) -> None:
    """Each case compiled (inductor's C++ backend) against torch, on one group and on two interleaved
    groups laid out channels-last, then a state-dict round trip. ``per_run``: an update over flat runs,
    which must not recompile for the second layout's runs (other sizes, other buffers, other options
    in the second group). Tolerance: rtol 1e-4, atol 1e-5 (RMSprop's centered variance subtracts nearly
    equal numbers, so the compiled and torch's rounding differ by up to 1e-4 relative there)."""
    from torch._dynamo.utils import counters

    for cls, ref_cls, kwargs in cases.values():
        compare_with_torch(cls, ref_cls, kwargs, steps=8, rtol=1e-4, atol=1e-5)
        graphs = counters["stats"]["unique_graphs"]
        compare_with_torch(cls, ref_cls, kwargs, split=True, second=dict(lr=0.02, weight_decay=0.0), steps=8,
                           channels_last=True, rtol=1e-4, atol=1e-5)
        round_trip(cls, kwargs)
        assert not cls._kernel._failed and cls._kernel._compiled is not None
        assert not per_run or counters["stats"]["unique_graphs"] == graphs, "a new run recompiled the update"


def grad_scaler_matches_torch(cls, ref_cls, kwargs: dict, steps: int = 3) -> None:
    """torch.amp.GradScaler drives ours as it drives torch's (fused optimizers get the scale, the others
    unscaled gradients), skipping the step whose gradients overflowed."""
    params, grads = flat_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = cls(params, **kwargs), ref_cls(ref, **kwargs)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for scaler in scalers:
        scaler.scale(torch.ones(()))  # the scale exists once a loss was scaled
    g = torch.Generator().manual_seed(4)
    for step in range(steps):
        scaled = [torch.randn(p.shape, generator=g) * 1024.0 for p in params]
        if step == 1:
            scaled[0][0] = float("inf")
        for p, r, value in zip(params, ref, scaled):
            p.grad.copy_(value)
            r.grad = value.clone()
        for opt, scaler in zip((ours, theirs), scalers):
            scaler.step(opt)
            scaler.update()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert scalers[0].get_scale() == scalers[1].get_scale() < 1024.0

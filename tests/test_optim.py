"""rptrain.optim: torch's fused Adam/AdamW kernel over contiguous runs gives torch's numbers."""
from __future__ import annotations

import copy

import pytest
import torch

from rptrain.optim import Adam, AdamW


def flat_params(shapes, seed=0):
    """Parameters and gradients as views of two flat buffers, the way the engine hands them over."""
    g = torch.Generator().manual_seed(seed)
    total = sum(torch.Size(s).numel() for s in shapes)
    data, grads = torch.randn(total, generator=g), torch.zeros(total)
    params, offset = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        p = torch.nn.Parameter(data[offset : offset + n].view(s))
        p.grad = grads[offset : offset + n].view(s)
        params.append(p)
        offset += n
    return params, grads


SHAPES = [(4, 3), (3,), (5, 5, 2), (7,), (2, 2)]


@pytest.mark.parametrize("cls, ref_cls", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)])
@pytest.mark.parametrize("groups", ["one", "two"])
def test_flat_step_matches_torch(cls, ref_cls, groups):
    params, grads = flat_params(SHAPES)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-7)
    if groups == "two":  # e.g. no weight decay on biases: groups interleave in memory
        ours = cls([{"params": params[0::2]}, {"params": params[1::2], "weight_decay": 0.0}], **kw)
        theirs = ref_cls([{"params": ref[0::2]}, {"params": ref[1::2], "weight_decay": 0.0}], fused=True, **kw)
    else:
        ours, theirs = cls(params, **kw), ref_cls(ref, fused=True, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads.copy_(torch.randn(grads.shape, generator=g))
        for p, r in zip(params, ref):
            r.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=0, atol=0)  # the same kernel, elementwise
    # The moments are views of one flat buffer, and state dicts look like torch's.
    m = [ours.state[p]["exp_avg"] for p in params]
    assert m[0].untyped_storage().data_ptr() == m[1].untyped_storage().data_ptr() or groups == "two"
    assert set(ours.state_dict()["state"][0]) == set(theirs.state_dict()["state"][0])


def test_state_dict_round_trip_continues_identically():
    params, grads = flat_params(SHAPES)
    opt = Adam(params, lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        grads.copy_(torch.randn(grads.shape, generator=g))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin_params, twin_grads = flat_params(SHAPES)
    with torch.no_grad():
        for a, b in zip(twin_params, params):
            a.copy_(b)
    twin = Adam(twin_params, lr=1e-2)
    twin.load_state_dict(saved)
    for _ in range(2):
        step_grads = torch.randn(grads.shape, generator=g)
        grads.copy_(step_grads)
        twin_grads.copy_(step_grads)
        opt.step()
        twin.step()
    for a, b in zip(twin_params, params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_grad_scale_divides_and_found_inf_skips():
    params, grads = flat_params(SHAPES)
    ref_params, ref_grads = flat_params(SHAPES)
    opt, ref = Adam(params, lr=1e-2), Adam(ref_params, lr=1e-2)
    grads.fill_(8.0)
    ref_grads.fill_(1.0)
    opt.grad_scale = torch.tensor(8.0)
    opt.step()
    del opt.grad_scale
    ref.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)
    before = [p.detach().clone() for p in params]
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_standalone_parameters_fall_back_to_torch():
    ps = [torch.nn.Parameter(torch.randn(3, 3).t()) for _ in range(2)]  # not contiguous
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = Adam(ps, lr=0.1)
    opt.step()
    assert all(torch.isfinite(p).all() for p in ps)


def test_runs_step_over_alignment_padding_only():
    """The engine pads tensors to 256 bytes: a run may cross padding, never another tensor."""
    data, grads = torch.zeros(256), torch.zeros(256)
    a = torch.nn.Parameter(data[0:10])
    b = torch.nn.Parameter(data[64:70])  # first 256-byte boundary after a: padding in between
    c = torch.nn.Parameter(data[80:90])  # not on a boundary: something could sit in 70..80
    for p, (lo, hi) in zip((a, b, c), ((0, 10), (64, 70), (80, 90))):
        p.grad = grads[lo:hi]
    opt = Adam([a, b, c])
    runs = __import__("rptrain.optim.flat", fromlist=["_FlatRuns"])._FlatRuns(opt).runs(opt.param_groups[0])
    assert [len(r) for r in runs] == [2, 1]
    grads.fill_(1.0)
    grads[10:64].zero_()
    opt.step()
    assert torch.all(data[10:64] == 0)  # padding stays zero
    assert torch.all(data[0:10] < 0) and torch.all(data[80:90] < 0)


def test_gradients_moved_between_steps_still_match_torch():
    """Runs are remembered per arrangement of the tensors: gradients that change places between
    steps (flat, then separate tensors, then one buffer in reverse order, then transposed views,
    then flat again) must not reuse a stale arrangement."""
    params, grads = flat_params([(4, 4), (4, 4), (3,)])
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = Adam(params, lr=1e-2), torch.optim.Adam(ref, lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(2)
    flat_grads = [p.grad for p in params]
    for arrangement in ("flat", "separate", "reversed", "transposed", "flat"):
        new = [torch.randn(p.shape, generator=g) for p in params]
        if arrangement == "flat":
            for p, view, value in zip(params, flat_grads, new):
                view.copy_(value)
                p.grad = view
        elif arrangement == "separate":
            for p, value in zip(params, new):
                p.grad = value.clone()
        elif arrangement == "transposed":  # torch's fused kernel alone would get these wrong
            for p, value in zip(params, new):
                p.grad = value.t().contiguous().t() if value.dim() == 2 else value.clone()
        else:
            backwards = torch.cat([v.reshape(-1) for v in reversed(new)])
            offset = backwards.numel()
            for p, value in zip(params, new):
                offset -= value.numel()
                p.grad = backwards[offset : offset + value.numel()].view(value.shape)
        for r, value in zip(ref, new):
            r.grad = value.clone()
        ours.step()
        theirs.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=0, atol=0, msg=arrangement)


def test_adam_with_decoupled_weight_decay_is_adamw():
    """The original library documents Adam(decoupled_weight_decay=True) as AdamW; the flat path must honour it."""
    from rptrain import OptimizerCtx, RoundPipe
    from rptrain.optim import Adam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    engine = RoundPipe(copy.deepcopy(model), devices=["cpu"])  # the step is the subject: compute on the reference's device
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=0.1, weight_decay=0.5, decoupled_weight_decay=True)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5, fused=True)
    x = torch.randn(3, 4)
    for _ in range(3):
        engine.forward_backward((x,), loss_fn=lambda out, _: out.pow(2).sum())
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        model(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    engine.synchronize()
    for name, p in model.named_parameters():
        torch.testing.assert_close(engine.state_dict()[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_a_state_tensor_replaced_between_steps_is_stepped_from():
    """The flat state is checked against optimizer.state every step (by identity, flat.py): a moment a
    user replaces is what the next step continues from, as in torch."""
    params, grads = flat_params(SHAPES)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = Adam(params, lr=1e-2), torch.optim.Adam(ref, lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        grads.copy_(torch.randn(grads.shape, generator=g))
        for p, r in zip(params, ref):
            r.grad = p.grad.clone()
        if i == 2:
            for opt, p in ((ours, params[2]), (theirs, ref[2])):
                opt.state[p]["exp_avg"] = torch.full_like(p, 0.5)
        ours.step()
        theirs.step()
    # Within an ulp or so (the re-made flat buffer is aligned unlike torch's lone tensor, so the CPU kernel
    # may take its scalar tail there); ignoring the replacement would be off by about lr.
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-8)


def test_an_fp32_master_at_bf16_offsets_is_one_run():
    """The engine's fp32 master shares its bf16 compute copy's offsets (128-element boundaries, 512 bytes in
    fp32); the master parameters say so (layout.ALIGN_ATTR), so the step is one kernel per flat tensor, not
    one per tensor whose size is not a multiple of 128 (a bf16 ResNet-34 on the H100: 17 runs before)."""
    from rptrain import OptimizerCtx, RoundPipe

    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 5)).to(torch.bfloat16)
    engine = RoundPipe(model, optim_dtype=torch.float32)
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-3)
    engine.forward_backward(input_args=(torch.randn(4, 7, dtype=torch.bfloat16),), label=torch.randint(0, 5, (4,)),
                            loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out.float(), y))
    runs = []

    def step_fn():
        opt.step()
        runs.extend(len(r) for r in opt._flat_runs.runs(opt.param_groups[0]))

    engine.step(step_fn)
    engine.synchronize()
    assert runs == [6]

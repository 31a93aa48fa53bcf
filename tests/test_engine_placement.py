"""The placement plan (where master, gradients and optimizer state live) and the memory-fit check made
before the engine allocates anything: hand-computed placements, the prediction against the engine's
own memory_report, and the one-line error of the CLI."""
from __future__ import annotations

import json

import pytest
import torch
from test_cli_helpers import error_lines, explain, rptrain_here
from torch import nn

from rptrain import OptimizerCtx, RoundPipe
from rptrain.engine import DoesNotFit
from rptrain.engine.fit import parse_size
from rptrain.engine.placement import GPU, HOST, Run, StateBytes, place
from rptrain.models import build_model
from rptrain.optim import AdamW

# Three trainable runs of bf16 (2 bytes) and a frozen one. On the GPU a trainable parameter takes
# master 4 + Adam 8 + two gradient buffers 8 = 20 bytes; on the host master 4 + Adam 8 + two gradient
# buffers 8 + two compute copies 4 = 24 bytes.
RUNS = [Run(0, "bfloat16", 100, 2, True), Run(1, "bfloat16", 400, 2, True), Run(2, "bfloat16", 200, 2, True),
        Run(3, "bfloat16", 50, 2, False)]


def test_everything_on_the_gpu_when_it_fits():
    p = place(RUNS, StateBytes(), gpu_free=20_000, gpu_compute=1_000, gpu_activations=500, host_budget=1_000)
    assert [r.state for r in p.runs] == [GPU, GPU, GPU, None]
    assert p.totals[GPU] == dict(master=2_800, grads=5_600, optimizer=5_600, compute=1_000, frozen=0, buffers=0,
                                 activations=500, pinned_rounding=0)
    assert p.total(HOST) == 100 and p.totals[HOST]["frozen"] == 100  # frozen weights: stored once, 50 x 2 bytes
    assert p.fits and p.params_on(GPU) == 700 and p.params_on(HOST) == 0


def test_split_is_a_prefix_of_the_layers():
    # room for state: 6_300 - 1_000 - 500 = 4_800 bytes. Layer 0 takes 100 x 20 = 2_000 (2_800 left);
    # layer 1 needs 8_000 and stays on the host, and so does layer 2 (its 4_000 would fit):
    # the GPU share is a prefix of each flat tensor (gpushare.py).
    p = place(RUNS, StateBytes(), gpu_free=6_300, gpu_compute=1_000, gpu_activations=500, host_budget=20_000)
    assert [r.state for r in p.runs] == [GPU, HOST, HOST, None] and p.gpu_layers == 1
    assert [r.step for r in p.runs] == [GPU, HOST, HOST, None]
    assert p.totals[GPU]["master"] == 400 and p.totals[GPU]["grads"] == 800 and p.totals[GPU]["optimizer"] == 800
    assert p.total(GPU) == 3_500
    host = {k: v for k, v in p.totals[HOST].items() if v}
    assert host == dict(master=2_400, grads=4_800, optimizer=4_800, compute=2_400, frozen=100)
    assert p.total(HOST) == 14_500 and p.fits
    text = str(p)
    assert "layers 0-0 bfloat16: master, grads, optimizer state on the GPU" in text
    assert "layers 1-2 bfloat16: master, grads, optimizer state on the HOST, step on the HOST" in text
    assert "layers 3-3 bfloat16: frozen weights on the HOST" in text
    # a smaller later layer that would fit does not jump the queue
    assert place(RUNS, StateBytes(), gpu_free=8_000, gpu_compute=0, host_budget=10**6).gpu_layers == 1


def test_everything_on_the_host_and_the_budgets():
    kw = dict(gpu_compute=1_000, gpu_activations=500, buffers=30, pinned_rounding=70)
    for p in (place(RUNS, StateBytes(), gpu_free=1_500, host_budget=17_000, **kw),  # no room left on the GPU
              place(RUNS, StateBytes(), gpu_free=10**9, host_budget=17_000, gpu_state=False, **kw)):  # today's engine
        assert [r.state for r in p.runs] == [HOST, HOST, HOST, None]
        # 700 trainable parameters x 24 bytes + frozen 100 + buffers 30 + pinned rounding 70
        assert p.total(HOST) == 16_800 + 200 and p.fits
    tight = place(RUNS, StateBytes(), gpu_free=1_499, host_budget=16_999, **kw)
    assert not tight.fits and tight.short() == {GPU: 1, HOST: 1}
    assert "DOES NOT FIT" in str(tight)


def test_default_host_budget(monkeypatch):
    from rptrain.engine import fit

    monkeypatch.setattr(fit, "physical_memory", lambda: 128 * 2**30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    budget, source = fit.host_budget(None)
    assert budget == 128 * 2**30 - int(0.1 * 128 * 2**30) and "less a 12.80 GiB reserve" in source
    monkeypatch.setattr(fit, "physical_memory", lambda: 16 * 2**30)
    assert fit.host_budget(None)[0] == 12 * 2**30  # at least 4 GiB stay for the rest
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two ranks on this host, each with the whole state
    assert fit.host_budget(None)[0] == 6 * 2**30
    assert fit.host_budget("96GiB") == (96 * 2**30, "max_host_memory")


def test_parse_size():
    assert parse_size(None) is None
    assert parse_size("96GiB") == 96 * 2**30 and parse_size("100 GB") == 10**11 and parse_size("1.5e3") == 1_500
    assert parse_size(4096) == 4096 and parse_size("2048") == 2048
    for bad in ("lots", "-5", 0, True, "3 parsecs"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad, "max_host_memory")


class Frozen(nn.Module):
    """A layer of a dtype of its own whose weights are frozen, between trainable ones."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32).to(torch.float64).requires_grad_(False)

    def forward(self, x):
        return self.proj(x.double()).float()


def _mixed_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Linear(64, 32), Frozen(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))


@pytest.mark.parametrize("name", ["llama_tiny", "mixed"])
def test_prediction_matches_memory_report(name):
    """The host bytes predicted before allocating equal what the engine then holds after async steps
    with AdamW (its second gradient buffer and the optimizer's state allocated), within 1% per kind.
    (The optimizer's flat state stops at the last parameter, the master at the next 256-byte boundary:
    tensors of fewer than 64 elements at the end of a dtype would cost more than 1% in a model this small.)"""
    model = build_model("llama_tiny") if name == "llama_tiny" else _mixed_model()
    engine = RoundPipe(model, gpu_state=False)  # everything on the host, also on a GPU (test_engine_gpu_state.py: the split)
    predicted = engine.placement.totals[HOST]
    with OptimizerCtx():
        opt = AdamW(engine.parameters(), lr=1e-3)
    if name == "llama_tiny":
        ids = torch.randint(0, 200, (2, 17))
        batch, loss_fn = ((ids[:, :-1], ids[:, 1:]),), lambda out, _: out
    else:
        batch, loss_fn = (torch.randn(8, 16),), lambda out, _: out.square().mean()
    engine.forward_backward(input_args=batch, loss_fn=loss_fn)
    engine.step(lambda: (opt.step(), opt.zero_grad()))  # allocates Adam's moments; the next call opens the second buffer
    engine.forward_backward(input_args=batch, loss_fn=loss_fn)
    report = engine.memory_report(opt)
    engine.close()
    assert report["grads"] == 2 * report["master"] and report["optimizer"] > 0
    if name == "mixed":
        assert report["frozen"] > 0 and report["buffers"] > 0
    for kind in ("master", "grads", "compute", "frozen", "buffers", "optimizer"):
        assert abs(predicted[kind] - report[kind]) <= 0.01 * report[kind], (kind, predicted[kind], report[kind])


def test_pinned_blocks_round_up_to_powers_of_two(monkeypatch):
    """On a GPU machine host.py pins its flat tensors, and PyTorch's caching host allocator rounds each
    block up to a power of two: the check counts those pages too. Blocks of at least
    pinned.EXACT_FROM_BYTES are mapped at their exact size instead: no rounding."""
    from rptrain.engine import fit, pinned

    class FakeGpu:
        is_cuda = True

    monkeypatch.setattr(fit, "gpu_budget", lambda devices, cap: (10 * 2**30, "free on the GPU"))
    # weight 1,000,000 + bias 1,000 fp32 (trainable), a frozen fp16 layer and BatchNorm's buffers
    layers = [nn.Linear(1000, 1000), nn.Linear(1000, 1000).half().requires_grad_(False), nn.BatchNorm1d(1000, affine=False)]
    p = fit.check_fit(layers[:1], torch.float32, [FakeGpu()], resident=True, max_host_memory="1GiB")
    compute, grads = 1_001_000 * 4, 1_001_024 * 4  # the master's region aligned to 1,001,024 elements
    # resident: two gradient buffers and the master (the GPU casts every version from it), each up to
    # 2**22 bytes; no compute copies on the host
    assert p.totals[HOST]["pinned_rounding"] == 3 * (2**22 - grads) and p.totals[HOST]["compute"] == 0
    assert p.totals[GPU]["compute"] == 3 * 4_004_000  # resident: the live copy and two upload slots
    p = fit.check_fit(layers[:1], torch.float32, [FakeGpu()], resident=True, max_host_memory="1GiB", compute_copies=True)
    # Tuning.refresh_gpu_share below 1: the host casts part of each version, into two compute copies
    assert p.totals[HOST]["pinned_rounding"] == 2 * (2**22 - compute) + 3 * (2**22 - grads)
    assert p.totals[HOST]["compute"] == 2 * compute
    p = fit.check_fit(layers, torch.float32, [FakeGpu()], resident=False, max_host_memory="1GiB")
    # flat tensors (layout.py aligns each tensor to 256 bytes): frozen fp16 weight + bias at 1,000,064;
    # fp32 buffers running mean + var at 1,024; int64 num_batches_tracked, 8 bytes (a power of two)
    frozen, buffers = 1_001_064 * 2, 2_024 * 4
    assert p.totals[HOST]["pinned_rounding"] == 2 * (2**22 - compute) + 2 * (2**22 - grads) + (2**21 - frozen) + (2**13 - buffers)
    assert p.totals[GPU]["compute"] == 2 * 4_004_000 + 3 * 4_004_000  # the largest layer (0) twice, its gradients three times
    monkeypatch.setattr(pinned, "EXACT_FROM_BYTES", 1)  # every block mapped at its exact size
    p = fit.check_fit(layers, torch.float32, [FakeGpu()], resident=False, max_host_memory="1GiB")
    assert p.totals[HOST]["pinned_rounding"] == 0


def test_does_not_fit_before_allocating():
    model = build_model("llama_tiny")
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(DoesNotFit) as info:
        RoundPipe(model, max_host_memory="1MiB", gpu_state=False)  # on a GPU machine the state would fit there
    message = str(info.value)
    assert "host memory needed" in message and "1.00 MiB available (max_host_memory)" in message
    for fragment in ("master", "grads", "optimizer", "optim_dtype=torch.bfloat16", "LoRA", "engine.max_host_memory=", "more GPUs"):
        assert fragment in message, fragment
    # Host compute copies exist only for a streamed engine (the CPU's); a resident GPU keeps them on the GPU.
    assert ("compute" in message) == bool(info.value.placement.totals["host"]["compute"])
    assert "\n" not in message
    assert [p.data_ptr() for p in model.parameters()] == before  # the engine took nothing over
    assert not info.value.placement.fits


def test_cli_prints_does_not_fit_as_one_line(tmp_path):
    run = tmp_path / "run"
    proc = rptrain_here(["model=llama_tiny", "data=synthetic_tokens", "trainer.max_steps=1", "engine.max_host_memory=1MiB",
                         "engine.gpu_state=false",
                         f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 2, explain(proc)
    lines = [line for line in error_lines(proc.stderr) if line.startswith("rptrain: error:")]
    assert len(lines) == 1 and "the training state does not fit" in lines[0] and "max_host_memory" in lines[0], explain(proc)
    assert "Traceback" not in proc.stderr
    assert json.loads((run / "status.json").read_text())["state"] == "failed"


def test_cli_refuses_a_bad_size(tmp_path, monkeypatch, capsys):
    from rptrain.cli.main import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["model=llama_tiny", "data=synthetic_tokens", "engine.max_host_memory=lots", f"output_root={tmp_path / 'out'}"])
    lines = error_lines(capsys.readouterr().err)
    assert info.value.code == 2 and len(lines) == 1 and "engine.max_host_memory='lots' is not a size" in lines[0], lines


def test_llama_8b_fits_one_h200_without_host_compute_copies(monkeypatch):
    """Llama-3.1-8B shapes (bf16, built on the meta device) on the H200 machine: 139 GiB free on the GPU,
    128 GiB of host memory. Resident, the host keeps no compute copies, and the default placement (30%
    of the GPU kept for activations) fits; counting the two copies the same placement would not (the 4
    bytes a host parameter they take are the whole difference)."""
    from rptrain.engine import fit
    from rptrain.engine.tuning import Tuning

    class H200:
        is_cuda, pins_memory = True, True

        def free_memory(self):
            return 139 * 2**30

    monkeypatch.setattr(fit, "physical_memory", lambda: 128 * 2**30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    layers = list(build_model("llama_8b", device="meta").to(torch.bfloat16))
    kw = dict(resident=True, gpu_state=True, gpu_reserve=Tuning.gpu_state_reserve)
    lean = fit.check_fit(layers, torch.float32, [H200()], **kw)
    assert lean.totals[HOST]["compute"] == 0 and 0 < lean.gpu_layers < len(layers) and lean.total(GPU) <= 139 * 2**30
    with pytest.raises(DoesNotFit) as info:
        fit.check_fit(layers, torch.float32, [H200()], compute_copies=True, **kw)
    copies = info.value.placement
    assert copies.gpu_layers == lean.gpu_layers and copies.totals[HOST]["compute"] == 2 * 2 * lean.params_on(HOST)
    assert copies.total(HOST) - lean.total(HOST) == copies.totals[HOST]["compute"]  # pinned: large blocks, mapped exactly
    assert "host memory needed" in str(info.value)


def test_engines_of_one_process_fit_against_what_the_open_ones_leave(monkeypatch):
    """Two hand-built engines used to fit each against the whole machine, together past it (an OOM kill
    instead of a refusal); the default budget now subtracts what the open engines hold, until they close."""
    from rptrain.engine import fit

    monkeypatch.setattr(fit, "_held", type(fit._held)())  # engines other tests left uncollected do not count here
    model = lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    need = RoundPipe(model(), devices=["cpu"], max_host_memory="1GiB").placement.total(HOST)
    monkeypatch.setattr(fit, "host_budget", lambda cap: (1_000_000, "a test budget") if cap is None else (fit.parse_size(cap), "max_host_memory"))
    first = RoundPipe(model(), devices=["cpu"])
    assert first.placement.host_budget == 1_000_000
    second = RoundPipe(model(), devices=["cpu"])
    assert second.placement.host_budget == 1_000_000 - need and "open engine(s) of this process hold" in second.placement.sources[HOST]
    explicit = RoundPipe(model(), devices=["cpu"], max_host_memory=need)  # an explicit cap is the engine's own
    assert explicit.placement.host_budget == need
    with pytest.raises(DoesNotFit, match="open engine"):
        RoundPipe(nn.Sequential(*[nn.Linear(128, 128) for _ in range(30)]), devices=["cpu"])
    for engine in (first, second, explicit):
        engine.close()
    assert RoundPipe(model(), devices=["cpu"]).placement.host_budget == 1_000_000

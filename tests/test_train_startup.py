"""Start-up at scale: the fit check runs on the meta-device model before its weights exist (#29, #32)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from rptrain import RoundPipe
from rptrain.engine import DoesNotFit, check_model_fits
from rptrain.models import build_model


def test_the_meta_check_is_the_engines_check():
    """check_model_fits on a meta model: the placement RoundPipe chooses for the built model, and its refusal word for word."""
    meta = build_model("llama_tiny", vocab_size=300, device="meta")
    real = build_model("llama_tiny", vocab_size=300)
    assert str(check_model_fits(meta)) == str(RoundPipe(real).placement)
    # gpu_state off: on a GPU the whole state of this tiny model would fit there and need no host memory
    with pytest.raises(DoesNotFit) as from_meta:
        check_model_fits(meta, max_host_memory=100_000, gpu_state=False)
    with pytest.raises(DoesNotFit) as from_engine:
        RoundPipe(real, max_host_memory=100_000, gpu_state=False)
    assert str(from_meta.value) == str(from_engine.value)


def test_the_meta_check_draws_no_random_numbers():
    """The model built after the check is initialised exactly as without it (same seed, same weights)."""
    torch.manual_seed(5)
    plain = build_model("llama_tiny", vocab_size=300).state_dict()
    torch.manual_seed(5)
    check_model_fits(build_model("llama_tiny", vocab_size=300, device="meta"))
    checked = build_model("llama_tiny", vocab_size=300).state_dict()
    assert all(torch.equal(plain[k], checked[k]) for k in plain)


@pytest.mark.slow
def test_a_model_that_cannot_fit_is_refused_before_it_is_built(tmp_path):
    """llama_1b (3.6 GiB of fp32 weights) on a 2 GiB budget: one line, exit 2, and the process never
    holds the model (peak 0.8 GiB measured; 4.3 GiB when the model was built before the check)."""
    # The peak is read in a wrapper process whose only child is the run: RUSAGE_CHILDREN of the test's own
    # process is the largest of every child it ever waited for (an earlier test's run, say).
    wrapper = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "sys.stderr.write(p.stderr); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "rptrain.cli.main", "model=llama_1b", "data=synthetic_tokens",
                           "engine.max_host_memory=2GiB", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    peak = int(proc.stdout.split()[-1]) * 1024
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "the training state does not fit" in lines[0], proc.stderr[-2000:]
    assert peak < 2 * 2**30, peak


def _cfg(model: str, **overrides):
    from hydra import compose, initialize_config_module

    from rptrain.train import schema

    schema.register_configs()
    data = "data=synthetic" if model.startswith("resnet") else "data=synthetic_tokens"
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        return compose("config", overrides=[f"model={model}", data, *[f"{k}={v}" for k, v in overrides.items()]])


@pytest.mark.parametrize("model, overrides", [("llama_tiny", {}), ("llama_tiny", {"model.tie_embeddings": "true"}), ("resnet18", {})])
def test_layer_by_layer_build_equals_the_plain_build(model, overrides):
    """train.model.build_model builds on meta and materialises layer by layer (resnet18, with buffers,
    as before): the weights, the tying and the CPU generator's state after it equal building the whole
    model directly where the layers are initialised (the CPU, or on a GPU machine the GPU)."""
    from rptrain.train.model import build_model as build_from_config
    from rptrain.train.model import init_device

    cfg = _cfg(model, **overrides)
    torch.manual_seed(7)
    layered = build_from_config(cfg, torch.float32, vocab_size=512)
    after_layered = torch.get_rng_state()
    torch.manual_seed(7)
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k not in ("_target_", "weights", "lora")}
    if kwargs.get("vocab_size", 0) is None:
        kwargs["vocab_size"] = 512
    plain = build_model(**kwargs, dtype=torch.float32, device=None if model.startswith("resnet") else init_device()).to("cpu")
    assert torch.equal(after_layered, torch.get_rng_state())
    a, b = layered.state_dict(), plain.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert len(list(layered.parameters())) == len(list(plain.parameters()))  # a tied head is one Parameter again


def test_model_weights_are_loaded_into_an_uninitialised_model_exactly(tmp_path):
    """model.weights: the layers are allocated without the random init the file overwrites, and hold the file's values."""
    from rptrain.train.model import build_model as build_from_config

    torch.manual_seed(1)
    src = build_model("llama_tiny", vocab_size=512, tie_embeddings=True)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    torch.manual_seed(2)
    state = torch.get_rng_state()
    loaded = build_from_config(_cfg("llama_tiny", **{"model.tie_embeddings": "true", "model.weights": str(tmp_path / "w.pt")}),
                               torch.float32, vocab_size=512)
    assert torch.equal(state, torch.get_rng_state())  # nothing drawn
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in src.state_dict().items())
    assert loaded[-1].lm_head.weight is loaded[0].embed_tokens.weight


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layers_initialised_on_the_gpu_land_on_the_host_reproducibly():
    """On a GPU machine the layers are drawn by CUDA's generator, one at a time: on the host afterwards,
    the same for the same seed, tied where the plain model ties, with the init's spread (std within 2%)."""
    from rptrain.train.model import materialise

    def build(seed):
        torch.manual_seed(seed)
        return materialise(build_model("llama_tiny", vocab_size=512, tie_embeddings=True, device="meta"))

    a, b = build(3), build(3)
    assert all(t.device.type == "cpu" for t in a.state_dict().values())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a[-1].lm_head.weight is a[0].embed_tokens.weight
    assert abs(a[0].embed_tokens.weight.std().item() / a[0].init_std - 1) < 0.02
    torch.manual_seed(3)
    whole = build_model("llama_tiny", vocab_size=512, tie_embeddings=True, device="cuda").to("cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), whole.state_dict().values()))


def test_the_engine_makes_a_meta_model_real_as_it_takes_it_in():
    """build_model_streamed + RoundPipe(materialise=...): the engine's weights are those of the model
    built whole (same seed, bit for bit), a tied head stays tied, and it trains like the model built whole."""
    from rptrain.train.model import build_model as build_from_config
    from rptrain.train.model import build_model_streamed

    cfg = _cfg("llama_tiny", **{"model.tie_embeddings": "true"})
    torch.manual_seed(7)
    meta, maker = build_model_streamed(cfg, torch.float32, vocab_size=512)
    assert maker is not None and all(p.is_meta for p in meta.parameters())
    streamed = RoundPipe(meta, materialise=maker)
    torch.manual_seed(7)
    plain = RoundPipe(build_from_config(cfg, torch.float32, vocab_size=512))
    a, b = streamed.state_dict(), plain.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert meta[-1].lm_head.weight is meta[0].embed_tokens.weight and not meta[0].embed_tokens.weight.is_meta
    ids = torch.randint(0, 512, (2, 16))
    for engine in (streamed, plain):
        opt = torch.optim.SGD(list(engine.optim_parameters()), lr=0.1)
        engine.forward_backward(input_args=((ids, ids),))
        engine.step(opt.step, is_async=False)
        engine.synchronize()
    a, b = streamed.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="on the meta device"):
        RoundPipe(build_from_config(cfg, torch.float32, vocab_size=512), materialise=maker)


STARTUP_PEAK = r"""
import re, resource, sys, torch
from rptrain import RoundPipe
from rptrain.models import build_model
from rptrain.train.model import Materialiser, materialise
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
def high_water():  # this address space's own peak: getrusage's ru_maxrss can carry the spawning parent's size
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
torch.manual_seed(0)
model = build_model("llama_tiny", vocab_size=4096, dim=384, n_layers=12, n_heads=6, n_kv_heads=2, dtype=torch.float32, device="meta")
layer = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in model)
maker = Materialiser(model, torch.device("cpu"))
own = []  # at each layer made real: how many layers hold weights in memory of their own (not the engine's)
def counting(i):
    own.append(sum(any(not p.is_meta and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in l.parameters())
                   for l in model))
    maker(i)
before = resident()
engine = RoundPipe(model, devices=["cpu"], materialise=counting, keep_user_weights=False)
print(high_water() - before, resident() - before, layer, max(own))
"""


def test_host_memory_peaks_at_the_engine_state_plus_one_layer():
    """A 24 M-parameter fp32 Llama made real as the engine takes it in: when each layer is made real, no
    earlier layer holds weights of its own (each went into the engine's storage), and the process's peak
    is its memory after start-up plus at most two layers (measured: about one)."""
    out = subprocess.run([sys.executable, "-c", STARTUP_PEAK], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True).stdout
    peak, after, layer, own = (int(x) for x in out.split())
    assert own == 0, own
    assert peak <= after + 2 * layer, (peak, after, layer)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gpu_state", [True, False])
def test_layers_initialised_on_the_gpu_go_straight_into_the_engine(gpu_state):
    """On a GPU machine each layer is drawn on the GPU and copied from there into the engine's state (the
    GPU share's master stays on the GPU): the weights of the model built whole on the GPU, bit for bit,
    and the user's module holds no GPU tensor afterwards."""
    from rptrain.train.model import build_model as build_from_config
    from rptrain.train.model import build_model_streamed

    cfg = _cfg("llama_tiny", **{"model.tie_embeddings": "true"})
    torch.manual_seed(3)
    meta, maker = build_model_streamed(cfg, torch.bfloat16, vocab_size=512)
    assert maker is not None and maker.device.type == "cuda"
    streamed = RoundPipe(meta, torch.bfloat16, gpu_state=gpu_state, keep_user_weights=False, materialise=maker)
    torch.manual_seed(3)
    plain = RoundPipe(build_from_config(cfg, torch.bfloat16, vocab_size=512), torch.bfloat16, gpu_state=gpu_state, keep_user_weights=False)
    a, b = streamed.state_dict(), plain.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
    assert all(p.device.type == "cpu" for p in meta.parameters())
    streamed.close()
    plain.close()


@pytest.mark.parametrize("case", ["llama3", "qwen2"])  # qwen2: a tied head; llama3: several shards
def test_a_hugging_face_folder_is_read_a_layer_at_a_time_as_the_engine_takes_it_in(case, tmp_path):
    """model=hf streamed: the engine's weights are the folder's, bit for bit as the model loaded whole, the
    tied head stays tied, and no layer but the one being read holds weights of its own."""
    from test_models_hf import save_case

    from rptrain.train.model import build_model as build_from_config
    from rptrain.train.model import build_model_streamed

    save_case(case, tmp_path / "folder")
    cfg = _cfg("hf", **{"model.path": str(tmp_path / "folder"), "data.seq_len": 12})
    meta, maker = build_model_streamed(cfg, torch.float32, vocab_size=61)
    assert maker is not None and all(p.is_meta for p in meta.parameters())
    own = []

    def counting(i):
        own.append(sum(any(not p.is_meta and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in layer.parameters())
                       for layer in meta))
        maker(i)

    # The host path on every machine (the GPU path: test_layers_initialised_on_the_gpu_go_straight_into_the_engine).
    streamed = RoundPipe(meta, devices=["cpu"], materialise=counting, keep_user_weights=False)
    whole = RoundPipe(build_from_config(cfg, torch.float32, vocab_size=61), devices=["cpu"])
    a, b = streamed.state_dict(), whole.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert max(own) == 0
    assert (meta[-1].lm_head.weight is meta[0].embed_tokens.weight) == (case == "qwen2")

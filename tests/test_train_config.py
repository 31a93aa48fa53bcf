"""The configs in conf/: every option composes and validates, the defaults are the tutorial's
setup, every knob of the schemas is visible in the YAML, and groups map onto constructors."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import rptrain
import rptrain.optim
from rptrain import RoundPipeRunConfig
from rptrain.models import build_model as registry_build
from rptrain.train import schema
from rptrain.train.errors import ConfigError
from rptrain.train.model import build_model
from rptrain.train.precision import build_scaler, torch_dtype
from rptrain.train.run_config import build_run_config
from rptrain.train.validate import validate_config

CONF = Path(__file__).resolve().parents[1] / "conf"
IMAGE_DATA = ["cifar100", "cifar10", "synthetic"]
LM_DATA = ["synthetic_tokens", "text", "chat"]


@pytest.fixture(scope="module")
def make():
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_defaults_are_the_tutorials_setup(make):
    cfg = make()
    assert cfg.model.name == "resnet34" and list(cfg.model.widths) == [64, 128, 256, 512] and cfg.model.stem_channels == 32
    assert cfg.data.name == "cifar100" and cfg.model.num_classes == 100
    assert cfg.trainer.epochs == 20 and cfg.trainer.batch_size == 128 and cfg.trainer.max_steps is None
    assert cfg.optim.optimizer._target_ == "rptrain.optim.Adam" and cfg.optim.optimizer.lr == 1e-3
    assert cfg.optim.schedule.decay.value == "constant" and cfg.optim.schedule.warmup_steps == 0
    validate_config(cfg)
    tutorial = make("precision=fp16").precision
    assert tutorial.compute_dtype.value == "float16" and cfg.optim.master_dtype.value == "fp32"
    assert tutorial.grad_scaler.enabled and tutorial.grad_scaler.init_scale == 2.0**16


def test_precision_auto_is_bf16_on_a_bf16_gpu_the_tutorials_fp16_on_an_older_one_and_fp32_on_a_cpu(make, monkeypatch):
    """precision=auto (the default) picks by device when the config is read; otherwise it is precision=fp16."""
    cfg = make()
    assert OmegaConf.to_container(make("precision=fp16").precision.grad_scaler) == {
        **OmegaConf.to_container(cfg.precision.grad_scaler, resolve=True), "enabled": True}
    for cuda, bf16, dtype, scaled in ((False, False, "float32", False), (True, False, "float16", True), (True, True, "bfloat16", False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
        assert cfg.precision.compute_dtype.value == dtype and cfg.precision.grad_scaler.enabled == scaled
        assert build_scaler(cfg.precision).is_enabled() == scaled


def test_num_microbatch_null_is_one_for_an_image_model_on_one_gpu_and_the_engines_default_otherwise(make, monkeypatch):
    """An image model on one GPU keeps everything there: one microbatch (validate.num_microbatch says why); a
    language model, or several GPUs in one process, take the engine's GPUs + 1. The engine is handed the same."""
    from rptrain.train import validate

    lm = ["model=llama_tiny", "data=synthetic_tokens"]
    for gpus, image, language in ((0, 1, 1), (1, 1, 2), (2, 3, 3)):
        monkeypatch.setattr(validate, "default_microbatches", lambda: gpus + 1 if gpus else 1)
        assert validate.num_microbatch(make()) == image
        assert build_run_config(make().run_config, 20, validate.num_microbatch(make())).num_microbatch == image
        assert validate.num_microbatch(make(*lm)) == language
        assert validate.num_microbatch(make("run_config.num_microbatch=4")) == 4


def test_resnet34_from_the_config_is_the_tutorial_network(make):
    model = build_model(make(), torch.float16, device="meta")
    assert sum(p.numel() for p in model.parameters()) == 21_311_108  # the tutorial's build_resnet()
    assert len(model) == 3 + (3 + 4 + 6 + 3) + 3


@pytest.mark.parametrize("model", options("model"))
def test_every_model_builds_on_meta_with_compatible_data(make, model, tmp_path):
    data = ["data=synthetic"] if model.startswith("resnet") else ["data=synthetic_tokens"]
    if model == "hf":  # a Hugging Face folder: a tiny Llama saved by transformers
        import transformers
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, max_position_embeddings=256)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
        data.append(f"model.path={tmp_path}")
    cfg = make(f"model={model}", *data)
    validate_config(cfg)
    net = build_model(cfg, torch.bfloat16, device="meta", vocab_size=cfg.data.get("vocab_size"))
    assert isinstance(net, torch.nn.Sequential) and next(net.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("data", options("data"))
@pytest.mark.parametrize("precision", options("precision"))
def test_every_option_composes_and_validates(make, data, precision, tmp_path):
    optim = options("optim")[(len(data) + len(precision)) % len(options("optim"))]  # each optimizer with several data sets
    model = "model=llama_tiny" if data in LM_DATA else "model=resnet18"
    extra = [f"data.path={tmp_path}"] if data in ("text", "chat") else []
    cfg = make(model, f"data={data}", f"precision={precision}", f"optim={optim}", *extra)
    validate_config(cfg)
    scaler = build_scaler(cfg.precision)
    cuda = torch.cuda.is_available()
    assert isinstance(scaler, rptrain.GradScaler) and scaler.is_enabled() == (precision == "fp16" or (precision == "auto" and cuda))
    auto = torch.float16 if cuda else torch.float32
    assert torch_dtype(cfg.precision.compute_dtype) == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "auto": auto}[precision]


def _yaml_keys(node) -> set[str]:
    keys = set()
    for k, v in node.items():
        keys.add(k)
        if isinstance(v, dict):
            keys |= {f"{k}.{sub}" for sub in _yaml_keys(v)}
    return keys


def _schema_keys(cls) -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        keys.add(f.name)
        nested = getattr(schema, f.type, None) if isinstance(f.type, str) else None
        if dataclasses.is_dataclass(nested):
            keys |= {f"{f.name}.{sub}" for sub in _schema_keys(nested)}
    return keys


@pytest.mark.parametrize("path, cls", [
    *[(f"model/{m}.yaml", schema.ResNetConfig) for m in options("model") if m.startswith("resnet")],
    *[(f"model/{m}.yaml", schema.LlamaModelConfig) for m in options("model") if m.startswith("llama")],
    ("data/cifar100.yaml", schema.CifarDataConfig), ("data/cifar10.yaml", schema.CifarDataConfig),
    ("data/synthetic.yaml", schema.SyntheticImagesConfig), ("data/text.yaml", schema.TextDataConfig),
    ("data/synthetic_tokens.yaml", schema.SyntheticTokensConfig),
    *[(f"precision/{p}.yaml", schema.PrecisionConfig) for p in options("precision")],
    *[(f"optim/{o}.yaml", schema.OptimConfig) for o in options("optim")],
    ("run_config/default.yaml", schema.RunConfigConfig), ("trainer/default.yaml", schema.TrainerConfig),
])
def test_every_knob_is_visible_in_the_yaml(path, cls):
    raw = OmegaConf.to_container(OmegaConf.load(CONF / path))
    group = (CONF / path).parent
    keys: set = set()
    for entry in raw.pop("defaults", []):
        if isinstance(entry, dict):  # a shared file (model/lora/default.yaml) counts as this file's
            (sub, option), = entry.items()
            raw[sub] = OmegaConf.to_container(OmegaConf.load(group / sub / f"{option}.yaml"))
        elif isinstance(entry, str) and "/" not in entry and (group / f"{entry}.yaml").is_file():
            keys |= _yaml_keys(OmegaConf.to_container(OmegaConf.load(group / f"{entry}.yaml")))  # the option it builds on (precision/auto: fp16)
    keys |= _yaml_keys(raw)
    assert keys - {"defaults"} == _schema_keys(cls), path


def test_run_config_group_has_every_engine_field_and_maps_onto_it(make):
    engine_fields = {f.name for f in dataclasses.fields(RoundPipeRunConfig)}
    assert engine_fields == {f.name for f in dataclasses.fields(schema.RunConfigConfig)}
    cfg = make("run_config.num_microbatch=3", "run_config.recompute_grain=layer", "run_config.preserve_rng_state=false",
               "run_config.output_device=cpu", "run_config.merge_output=rptrain.engine.batching.merge_outputs",
               "run_config.execute_plan.forward=[4,9]")
    rc = build_run_config(cfg.run_config, num_layers=22)
    assert rc.num_microbatch == 3 and rc.recompute_grain == "layer" and rc.preserve_rng_state is False
    assert rc.output_device == torch.device("cpu") and callable(rc.merge_output)
    assert rc.execute_plan.forward == ((0, 4), (4, 9), (9, 22)) and rc.execute_plan.backward == rc.execute_plan.forward
    assert build_run_config(make().run_config, 22) == RoundPipeRunConfig()


def test_optimizer_yaml_instantiates_the_class_it_names(make):
    from hydra.utils import instantiate

    params = [torch.nn.Parameter(torch.zeros(2))]
    for name, cls in (("adam", rptrain.optim.Adam), ("adamw", rptrain.optim.AdamW)):
        opt = instantiate(make(f"optim={name}").optim.optimizer, params=params, _convert_="all")
        assert type(opt) is cls


@pytest.mark.parametrize("overrides, message", [
    (["trainer.batch_size=3", "run_config.num_microbatch=4"], "trainer.batch_size=3"),
    (["model=llama_tiny"], "data=text|synthetic_tokens"),
    (["data=synthetic", "trainer.log_interval=0"], "trainer.log_interval=0"),
    (["optim.schedule.min_lr_ratio=2"], "min_lr_ratio"),
    (["optim.optimizer._target_=torch.optim.SGD", "optim.master_dtype=bf16"], "does not implement a bf16 master"),
    (["data=cifar10", "data.num_classes=100"], "data.num_classes=100"),
    (["model=llama_tiny", "data=synthetic_tokens", "model.vocab_size=10"], "model.vocab_size=10"),
])
def test_semantic_checks(make, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        validate_config(make(*overrides))


def test_model_group_maps_onto_the_registry_builder(make):
    cfg = make("model=resnet18", "model.widths=[8,16,32,64]", "data=cifar10")
    torch.manual_seed(0)
    ours = build_model(cfg, torch.float32)
    torch.manual_seed(0)
    theirs = registry_build("resnet18", num_classes=10, widths=(8, 16, 32, 64))
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))


@pytest.mark.parametrize("fuse", [True, False])
def test_engine_switches_reach_the_engines_tuning(make, fuse):
    """engine.compile and engine.fuse_microbatches are the engine's Tuning.compile_stages and fuse_microbatches."""
    from rptrain.train.dist import Dist
    from rptrain.train.setup import build_engine

    cfg = make("model=resnet18", "model.widths=[4,4,4,4]", "model.stem_channels=4", f"engine.fuse_microbatches={str(fuse).lower()}")
    engine = build_engine(cfg, build_model(cfg, torch.float32), Dist())
    try:
        assert engine._tuning.fuse_microbatches is fuse and engine._tuning.compile_stages is False
    finally:
        engine.close()


@pytest.mark.parametrize("data, length", [("text", "data.seq_len"), ("chat", "data.max_seq_len"), ("synthetic_tokens", "data.seq_len")])
def test_out_of_gpu_memory_names_the_data_s_own_length_key(make, data, length):
    """A language model's line names the length key its data config has; its microbatches are never joined
    (its layers are not traced as joinable), so engine.fuse_microbatches is not offered."""
    from rptrain.train.out_of_memory import out_of_gpu_memory

    cfg = make("model=llama_tiny", f"data={data}", "run_config.num_microbatch=2")
    line = str(out_of_gpu_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB. Other words."), cfg, 2, "kept", 1))
    assert line.startswith(f"out of GPU memory at step 3 (Tried to allocate 1.00 GiB): lower trainer.batch_size or {length}, or "), line
    assert "fuse_microbatches" not in line and line.endswith("; kept")

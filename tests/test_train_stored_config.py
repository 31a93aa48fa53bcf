"""A config read back from a checkpoint or a run's .hydra/config.yaml is data: crafted files with a
`_target_` (nested or not), unknown keys or wrong types are refused with one line at every entry point
(rptrain-export, rptrain-generate, model.weights, trainer.resume) and never run code."""
from __future__ import annotations

import copy

import pytest
import torch
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from rptrain.cli import export as export_cli
from rptrain.cli import generate as generate_cli
from rptrain.train import schema
from rptrain.train.checkpoint import load_checkpoint, save_checkpoint
from rptrain.train.errors import CheckpointError
from rptrain.train.model import build_model
from rptrain.train.stored_config import checked_config
from test_cli_helpers import TINY, error_lines, explain, rptrain_here

LM = ["model=llama_tiny", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1", "model.vocab_size=32",
      "data=synthetic_tokens", "data.vocab_size=32", "precision=fp32"]


@pytest.fixture(scope="module")
def good():
    """A real llama_tiny run's stored config and weights."""
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=LM)
    model = build_model(cfg, torch.float32)
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), model.state_dict()


def payloads(marker):
    """(what is changed, the crafted config maker): each would write `marker` if instantiated."""
    write = {"_target_": "pathlib.Path.write_text", "self": str(marker), "data": "pwned"}

    def nested(c):
        c["model"]["dim"] = dict(write)

    def top(c):
        c["model"].update(write)

    def deep(c):
        c["model"]["lora"]["targets"] = [dict(write)]

    def in_data(c):
        c["data"]["seed"] = dict(write)

    def optimizer(c):
        c["optim"]["optimizer"] = {**write, "lr": 0.1}

    def through_an_import(c):
        c["optim"]["optimizer"]["_target_"] = "rptrain.optim.adam.torch.load"

    def load(c):
        c["model"]["weights"] = {"_target_": "torch.load", "f": str(marker), "weights_only": False}

    def unknown(c):
        c["model"]["payload"] = 1

    def wrong_type(c):
        c["model"]["dim"] = "sixteen"

    def other_name(c):
        c["model"]["name"] = "../../evil"

    return [nested, top, deep, in_data, optimizer, through_an_import, load, unknown, wrong_type, other_name]


def test_checked_config_accepts_a_real_one_and_refuses_each_payload(good, tmp_path):
    config, _ = good
    cfg = checked_config(copy.deepcopy(config), "x")
    assert cfg.model.dim == 16 and cfg.model.name == "llama_tiny" and cfg.data.vocab_size == 32
    marker = tmp_path / "pwned"
    for craft in payloads(marker):
        crafted = copy.deepcopy(config)
        craft(crafted)
        with pytest.raises(CheckpointError) as err:
            checked_config(crafted, "checkpoint c.pt")
        assert "\n" not in str(err.value) and "checkpoint c.pt" in str(err.value), (craft.__name__, err.value)
    assert not marker.exists()


def crafted_checkpoints(good, tmp_path):
    config, weights = good
    for craft in payloads(tmp_path / "pwned"):
        crafted = copy.deepcopy(config)
        craft(crafted)
        path = tmp_path / f"{craft.__name__}.pt"
        save_checkpoint(path, {"model": weights, "config": crafted})  # a valid checksum: the file is well-formed
        yield craft.__name__, path


def test_export_and_generate_refuse_crafted_checkpoints(good, tmp_path, capsys):
    for name, path in crafted_checkpoints(good, tmp_path):
        for main, args in ((export_cli.main, [str(path), str(tmp_path / f"out-{name}")]), (generate_cli.main, [str(path), "hi"])):
            with pytest.raises(SystemExit) as stop:
                main(args)
            lines = error_lines(capsys.readouterr().err)
            assert stop.value.code == 2 and len(lines) == 1 and "stored config" in lines[0], (name, lines)
    assert not (tmp_path / "pwned").exists()


def test_a_run_directory_config_yaml_is_checked_too(good, tmp_path, capsys):
    config, weights = good
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    crafted = copy.deepcopy(config)
    crafted["model"]["dim"] = {"_target_": "pathlib.Path.write_text", "self": str(tmp_path / "pwned"), "data": "x"}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(crafted))
    save_checkpoint(run / "checkpoints" / "last.pt", {"model": weights})  # no config inside: the run's is read
    with pytest.raises(SystemExit):
        export_cli.main([str(run), str(tmp_path / "out")])
    assert "model.dim" in capsys.readouterr().err and not (tmp_path / "pwned").exists()


def test_model_weights_refuses_a_crafted_checkpoint(good, tmp_path):
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        for name, path in crafted_checkpoints(good, tmp_path):
            cfg = compose("config", overrides=[*LM, f"model.weights={path}"])
            with pytest.raises(CheckpointError, match="stored config"):
                build_model(cfg, torch.float32, device="meta")
    assert not (tmp_path / "pwned").exists()


def test_model_target_on_the_command_line_is_not_instantiated(tmp_path):
    proc = rptrain_here([*TINY, "model._target_=pathlib.Path.write_text", "trainer.max_steps=1",
                         f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "model._target_" in lines[0], explain(proc)


def test_resume_never_builds_from_the_stored_config(tmp_path):
    """trainer.resume takes the command line's config; the checkpoint's (crafted) optimizer target is never built."""
    run = tmp_path / "run"
    proc = rptrain_here([*TINY, "trainer.max_steps=1", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    state = dict(load_checkpoint(run / "checkpoints" / "last.pt"))
    del state["checksum"], state["format"]
    state["config"]["optim"]["optimizer"] = {"_target_": "pathlib.Path.write_text", "self": str(tmp_path / "pwned"), "data": "x"}
    state["config"]["model"]["stem_channels"] = {"_target_": "pathlib.Path.write_text", "self": str(tmp_path / "pwned2"), "data": "x"}
    save_checkpoint(tmp_path / "crafted.pt", state)
    proc = rptrain_here([*TINY, "trainer.max_steps=2", f"trainer.resume={tmp_path / 'crafted.pt'}",
                         f"hydra.run.dir={tmp_path / 'resumed'}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


def test_environment_values_are_stored_as_written_and_read_back(good, tmp_path, monkeypatch):
    from rptrain.train.shown_config import shown_config

    monkeypatch.setenv("RPTRAIN_TEST_SECRET", "s3cr3t-token")
    config, _ = good
    cfg = OmegaConf.create({**config, "output_root": "${oc.env:RPTRAIN_TEST_SECRET}",
                            "logger": {"mlflow": {"experiment_name": "x-${output_root}", "tracking_uri": None, "run_name": None}}})
    shown = shown_config(cfg)
    assert shown["output_root"] == "${oc.env:RPTRAIN_TEST_SECRET}" and shown["logger"]["mlflow"]["experiment_name"] == "x-${output_root}"
    assert shown["model"]["dim"] == 16 and "s3cr3t" not in repr(shown)
    assert checked_config(shown, "c").output_root == "s3cr3t-token"  # resolved again where it is read
    monkeypatch.delenv("RPTRAIN_TEST_SECRET")
    assert checked_config(shown, "c").output_root == "${oc.env:RPTRAIN_TEST_SECRET}"  # not set here: as written

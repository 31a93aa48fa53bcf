"""logger=[jsonl, tensorboard, wandb, mlflow]: what each tracker receives, read back from its own files.

TensorBoard and MLflow are real (their event files and file store are read back with their own
readers); W&B is a recording stand-in put in sys.modules, because the wandb wheel and its service
binary are too heavy for the test environment; the calls it records are wandb's public API.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_module

from rptrain.train import schema
from rptrain.train.errors import ConfigError
from rptrain.train.loggers import Loggers, check_loggers

RECORDS = [
    {"kind": "train", "step": 1, "epoch": 1, "loss": 2.5, "acc": 0.1, "lr": 1e-3, "time": 0.1},
    {"kind": "train", "step": 2, "epoch": 1, "loss": 2.25, "acc": 0.2, "lr": 1e-3, "time": 0.2},
    {"kind": "eval", "step": 2, "epoch": 1, "loss": 2.0, "acc": 0.3, "time": 0.2},
]
SUMMARY = {"status": "completed", "steps": 2, "final": {"train_loss": 2.4, "test_loss": 2.0}, "samples_per_s": 50.0}


@pytest.fixture(scope="module")
def make():
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=["data=synthetic", "model=resnet18", *overrides])


def _run(cfg, run_dir, state="completed"):
    loggers = Loggers(cfg, run_dir)
    for record in RECORDS:
        loggers.log(record)
    loggers.finish(SUMMARY if state == "completed" else None, state)
    loggers.finish(None, "failed")  # a second finish (job.py's finally) does nothing


def test_tensorboard_scalars_config_and_summary(make, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(make("logger=[jsonl,tensorboard]"), tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]  # noqa: E731
    assert scalars("train/loss") == [(1, 2.5), (2, 2.25)] and scalars("eval/acc") == [(2, pytest.approx(0.3))]
    assert scalars("final/test_loss") == [(2, 2.0)] and scalars("final/samples_per_s") == [(2, 50.0)]
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    assert "resnet18" in texts["config/text_summary"] and '"test_loss": 2.0' in texts["summary/text_summary"]


def test_mlflow_params_metrics_summary_in_a_file_store_under_the_run_dir(make, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _run(make("logger=[jsonl,mlflow]", "trainer.batch_size=48"), tmp_path)
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    client = mlflow.MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("rptrain").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["trainer.batch_size"] == "48" and run.data.params["model.name"] == "resnet18"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train.loss")]
    assert sorted(history) == [(1, 2.5), (2, 2.25)]
    assert run.data.metrics["final.test_loss"] == 2.0
    summary = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/summary.json")
    assert summary["final"] == SUMMARY["final"]


class FakeWandb(SimpleNamespace):
    """Records wandb.init / run.log / run.summary.update / run.finish."""

    def __init__(self):
        super().__init__(calls=[])

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        calls = self.calls
        return SimpleNamespace(
            log=lambda values, step: calls.append(("log", step, values)),
            summary=SimpleNamespace(update=lambda values: calls.append(("summary", values))),
            finish=lambda exit_code: calls.append(("finish", exit_code)),
        )


@pytest.mark.parametrize("state, exit_code", [("completed", 0), ("failed", 1)])
def test_wandb_is_offline_by_default_and_gets_scalars_config_summary(make, tmp_path, monkeypatch, state, exit_code):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # "installed"
    _run(make("logger=[jsonl,wandb]"), tmp_path, state)
    (_, init), *rest = fake.calls
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path) and init["name"] == tmp_path.name
    assert init["config"]["model"]["name"] == "resnet18" and init["project"] == "rptrain"
    logs = [c for c in rest if c[0] == "log"]
    assert logs[0] == ("log", 1, {"train/epoch": 1.0, "train/loss": 2.5, "train/acc": 0.1, "train/lr": 1e-3, "train/time": 0.1})
    assert [c[1] for c in logs] == [1, 2, 2] and logs[2][2]["eval/loss"] == 2.0
    summaries = [c[1] for c in rest if c[0] == "summary"]
    assert summaries == ([{"final/train_loss": 2.4, "final/test_loss": 2.0, "final/samples_per_s": 50.0, "steps": 2, "status": "completed"}]
                         if state == "completed" else [])
    assert rest[-1] == ("finish", exit_code) and sum(c[0] == "finish" for c in rest) == 1


def test_a_tracker_asked_for_but_not_installed_is_one_line(make, monkeypatch):
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logger=wandb: the wandb package is not installed: pip install wandb"):
        check_loggers(make("logger=[jsonl,tensorboard,wandb]"))
    check_loggers(make("logger=[jsonl,tensorboard]"))
    assert Loggers().trackers == []  # the other ranks open nothing

"""Bad input: one line on stderr naming the key or file and the fix, exit code 2, no run directory
that could pass for a finished one.

Most cases call the entry point in this process (they are rejected before Hydra starts, so no
torch work happens); two run it as a subprocess to check the whole path, including a failure
that only shows once the run has started.
"""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from cifar_fixture import write_fake_cifar
from test_cli_helpers import TINY, error_lines, explain, rptrain, rptrain_here
from test_cli_sweeps import SMALL

from rptrain.cli.main import main
from rptrain.train.checkpoint import save_checkpoint


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """Run `rptrain ARGS` in-process in an empty directory; return (exit code, stderr lines)."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, list[str]]:
        with pytest.raises(SystemExit) as exit_info:
            main([*args, f"output_root={tmp_path / 'out'}"])
        err = capsys.readouterr().err
        return exit_info.value.code, error_lines(err)

    yield run
    assert not (tmp_path / "out").exists(), "a rejected command created a run directory"


def expect_error(result: tuple[int, list[str]], *fragments: str) -> None:
    code, lines = result
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("rptrain: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_unknown_group_option(cli):
    expect_error(cli("model=resnet35"), "model=resnet35", "resnet34", "llama_tiny")
    expect_error(cli("precision=fp8"), "precision=fp8", "bf16, fp16, fp32")


def test_misspelled_keys(cli):
    expect_error(cli("trainer.batch_sise=8"), "trainer.batch_sise", "did you mean trainer.batch_size?")
    expect_error(cli("modle=resnet18"), "modle", "did you mean model?")
    expect_error(cli("model.widthz=[8,16,32,64]"), "model.widthz", "model.widths")
    expect_error(cli("+trainer.epoch=3"), "trainer.epoch", "trainer.epochs")  # appended keys are checked too


def test_wrong_types_and_values(cli):
    expect_error(cli("trainer.batch_size=abc"), "trainer.batch_size", "Integer")
    expect_error(cli("data.pipeline=pil"), "data.pipeline", "tensor, torchvision")
    expect_error(cli("trainer.epochs=0"), "trainer.epochs=0")
    expect_error(cli("optim.optimizer.betas=[0.9,1.5]"), "optim.optimizer.betas")
    expect_error(cli("trainer.batch_size=1,2"), "add -m")
    expect_error(cli("trainer.batch_size=["), "cannot parse")


def test_bad_command_line_flags(cli):
    expect_error(cli("--no-such-flag"), "unrecognized arguments: --no-such-flag", "rptrain --help")
    expect_error(cli("-m", "--cfg", "job"), "only one of")
    expect_error(cli("--resolve"), "--resolve")


def test_batch_smaller_than_microbatches(cli):
    expect_error(cli(*TINY, "trainer.batch_size=2", "run_config.num_microbatch=4"),
                 "trainer.batch_size=2", "run_config.num_microbatch=4", "raise trainer.batch_size")


def test_every_job_of_a_sweep_is_checked_before_the_first_runs(cli):
    expect_error(cli("-m", *TINY, "trainer.batch_size=4", "run_config.num_microbatch=1,2,8"), "run_config.num_microbatch=8")


def test_bad_run_config_and_model_values(cli):
    expect_error(cli(*TINY, "run_config.execute_plan.forward=[100]"), "run_config", "ExecutePlan")
    expect_error(cli(*TINY, "run_config.split_input=nowhere.split"), "run_config.split_input=nowhere.split")
    expect_error(cli("model=llama_tiny", "data=synthetic_tokens", "model.dim=30"), "model=llama_tiny", "n_heads")
    expect_error(cli("model=llama_tiny", "data=synthetic_tokens", "data.seq_len=1000"), "data.seq_len=1000", "model.max_seq_len=256")


def test_bad_engine_values(cli):
    expect_error(cli(*TINY, "engine.optimizer_threads=0"), "engine.optimizer_threads=0", "positive integer")
    expect_error(cli(*TINY, "engine.cuda_graphs=maybe"), "engine.cuda_graphs")
    expect_error(cli(*TINY, "data.chunk_batches=0"), "data.chunk_batches=0", "positive integer")


def test_model_and_data_that_do_not_fit(cli):
    expect_error(cli("model=resnet34", "data=synthetic_tokens"), "model=resnet34", "data=cifar100|cifar10|synthetic")
    expect_error(cli("model=llama_tiny", "data=cifar100"), "model=llama_tiny", "data=text|synthetic_tokens")
    expect_error(cli("model=llama_tiny", "data=text"), "data.path is required", "data.path=")


def test_missing_dataset_with_download_off(cli, tmp_path):
    expect_error(cli("data.root=" + str(tmp_path / "nowhere"), "data.download=false"),
                 "CIFAR-100 not found under", "data.root", "data.download=true", "data=synthetic")
    expect_error(cli("model=llama_tiny", "data=text", f"data.path={tmp_path / 'missing.txt'}"), "missing.txt", "data.path")


def test_modified_dataset_fails_the_checksum(cli, tmp_path):
    root = write_fake_cifar(tmp_path / "cifar", "cifar10", n_train=20, n_test=10)
    expect_error(cli("data=cifar10", f"data.root={root}", "data.download=false"), "checksum", "data.verify_checksums=false")


def test_missing_dataset_without_network(cli, tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", offline)
    monkeypatch.setattr(socket, "create_connection", offline)
    expect_error(cli(f"data.root={tmp_path / 'empty'}"), "CIFAR-100 download", "failed", "data.root")


def test_unwritable_output_directory(cli, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    expect_error(cli(*TINY, f"hydra.run.dir={blocker / 'run'}"), "hydra.run.dir", "a_file is a file")
    expect_error(cli("-m", *TINY, f"hydra.sweep.dir={blocker / 'sweep'}"), "hydra.sweep.dir")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        expect_error(cli(*TINY, f"hydra.run.dir={locked / 'run'}"), "not writable")


def test_bad_values_caught_before_a_run_directory_exists(cli, tmp_path):
    expect_error(cli(*TINY, "precision.grad_scaler.growth_factor=1"), "precision.grad_scaler.growth_factor=1", "must be > 1")
    expect_error(cli(*TINY, "precision.grad_scaler.backoff_factor=1.5"), "precision.grad_scaler.backoff_factor=1.5")
    expect_error(cli(*TINY, "optim.optimizer.eps=-1e-8"), "optim.optimizer.eps=-1e-08", "must be >= 0")
    if not torch.cuda.is_available():
        expect_error(cli(*TINY, "data.augment_device=cuda"), "data.augment_device=cuda", "no CUDA device")
    expect_error(cli("model=llama_tiny", "data=synthetic_tokens", f"model.weights={tmp_path / 'nope.safetensors'}"),
                 "model.weights=", "nope.safetensors", "no such file")
    empty = tmp_path / "corpus"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    expect_error(cli("model=llama_tiny", "data=text", f"data.path={empty}"), f"data.path={empty}", "empty")


def test_cifar_labels_that_are_not_class_indices(cli, tmp_path):
    """A modified copy (data.verify_checksums=false) is read before the run: labels out of range,
    negative or not integers are refused with the file and the label's position."""
    import pickle

    root = write_fake_cifar(tmp_path / "cifar", "cifar10", n_train=20, n_test=10)
    batch = root / "cifar-10-batches-py" / "data_batch_2"
    original = batch.read_bytes()
    for bad in (10, -1, 2.5):
        entry = pickle.loads(original, encoding="latin1")
        entry["labels"][1] = bad
        batch.write_bytes(pickle.dumps(entry))
        expect_error(cli("data=cifar10", f"data.root={root}", "data.download=false", "data.verify_checksums=false"),
                     "cifar-10-batches-py", f"training label 5 is {bad!r}", "0..9")


def test_output_root_that_cannot_be_created(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, "output_root=/proc/x"])  # root may "write" anywhere, but not there
    expect_error((exit_info.value.code, error_lines(capsys.readouterr().err)), "/proc/x", "choose another output_root")


def _tiny_state(**fingerprint) -> dict:
    return {"fingerprint": {"model": "resnet18", "params": 1, "shapes": "x", **fingerprint}, "loader": {"batch_size": 16}}


def test_corrupt_or_foreign_checkpoint(cli, tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint")
    expect_error(cli(*TINY, f"trainer.resume={garbage}"), str(garbage), "corrupt", "trainer.resume=null")
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    expect_error(cli(*TINY, f"trainer.resume={foreign}"), str(foreign), "not an rptrain checkpoint")
    expect_error(cli(*TINY, f"trainer.resume={tmp_path / 'nothing.pt'}"), "nothing.pt", "no such checkpoint")
    expect_error(cli(*TINY, f"trainer.resume={tmp_path}"), "no checkpoints/ in that directory")


def test_checkpoint_of_another_model(cli, tmp_path):
    path = tmp_path / "other" / "checkpoints" / "last.pt"
    save_checkpoint(path, _tiny_state(model="resnet50", params=123))
    expect_error(cli(*TINY, f"trainer.resume={path.parent.parent}"), str(path), "resnet50", "resnet18", "trainer.resume=null")


def test_dataset_problem_found_after_the_start_marks_the_run_failed(tmp_path):
    """A corpus too short for one sequence is only found while loading it, after Hydra made the
    run directory: exit 2, one line, and status.json says failed (no summary.json)."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("too short")
    run = tmp_path / "run"
    proc = rptrain_here(["model=llama_tiny", "data=text", f"data.path={corpus}", "data.seq_len=64", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 2, explain(proc)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "data.seq_len" in lines[0] and str(corpus) in lines[0], explain(proc)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "data.seq_len" in status["error"]
    assert not (run / "summary.json").exists()


@pytest.mark.slow
def test_rejected_command_end_to_end(tmp_path):
    proc = rptrain(["trainer.batch_sise=8"], tmp_path)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "rptrain: error: trainer.batch_sise is not a config key (did you mean trainer.batch_size?): "
        "check the spelling; `rptrain --cfg job` prints every key"
    ], explain(proc)
    assert not (tmp_path / "outputs").exists()


def test_preflight_reads_optunas_search_space(cli, monkeypatch):
    """Both ends of an interval and every choice are composed and checked before anything starts."""
    code, lines = cli("-m", *SMALL, "hydra/sweeper=optuna", "trainer.batch_size=choice(16,3)", "run_config.num_microbatch=4",
                      "optim.optimizer.lr=tag(log,interval(1e-4,1e-2))")
    assert code == 2 and len(lines) == 1 and "trainer.batch_size=3 is smaller than run_config.num_microbatch=4" in lines[0], lines
    code, lines = cli("-m", *SMALL, "optim.optimizer.lr=interval(1e-4,1e-2)")
    assert code == 2 and lines == ["rptrain: error: optim.optimizer.lr=interval(1e-4,1e-2): interval() is sampled by a sweeper "
                                   "such as Optuna: add hydra/sweeper=optuna, or list the values (a,b,c) or use range()"], lines
    code, lines = cli(*SMALL, "trainer.objective=test_ppl")
    assert code == 2 and "trainer.objective=test_ppl is not a final metric of resnet18: choose one of test_loss, test_acc" in lines[0]
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    code, lines = cli(*SMALL, "logger=[jsonl,tensorboard]")
    assert code == 2 and "logger=tensorboard: the tensorboard package is not installed" in lines[0], lines

"""Issue 22: the training loop reads nothing back from the device between log steps, and what
it logs equals the per-step numbers; the image task's step against plain PyTorch; the epoch's
wall-clock throughput."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from rich.console import Console

from rptrain import GradScaler, RoundPipe, RoundPipeRunConfig
from rptrain.models import build_model
from rptrain.train import schema
from rptrain.train import meters, setup
from rptrain.train.loop import Trainer
from rptrain.train.memory_format import choose_memory_format
from rptrain.train.signals import StopRequest
from rptrain.train.tasks import ImageTask, StepResult
from test_cli_helpers import TINY, read_jsonl

# The loop and its data pipeline; the engine waits for its own devices at the end of each call, by design.
PACKAGE = Path(__import__("rptrain").__file__).parent
LOOP_DIRS = (str(PACKAGE / "train"), str(PACKAGE / "data"))
# Every way a tensor's value reaches Python or the host; each waits for the device that computes it.
READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "cpu")


def tiny_resnet() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return build_model("resnet18", num_classes=10, widths=(4, 8, 8, 8), stem_channels=4)


def test_image_step_matches_plain_pytorch():
    """Loss and correct count of one step (two microbatches) against the model run whole by
    plain PyTorch with the same weights: fp32, tolerance 1e-5 on the loss, exact count."""
    model = tiny_resnet()
    reference = tiny_resnet()
    engine = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 10, (6,))
    scaler = GradScaler(init_scale=8.0)
    result = ImageTask(2, torch.float32).train_step(engine, (x, y), scaler)
    device = engine.devices[0]  # the reference computes where the engine does (TF32 off: conftest)
    reference.to(device).train()
    x, y = x.to(device), y.to(device)
    # BatchNorm normalises per microbatch in the engine: the reference runs the same halves.
    logits = torch.cat([reference(x[:3]), reference(x[3:])])
    loss = sum(F.cross_entropy(logits[i : i + 3], y[i : i + 3], reduction="sum") for i in (0, 3)) / 6
    assert isinstance(result.loss, torch.Tensor) and len(result.correct) == 1  # one count from the returned logits, not read yet
    assert result.loss.item() * result.loss_factor == pytest.approx(loss.item(), rel=1e-5)
    assert sum(int(c) for c in result.correct) == int((logits.argmax(1) == y).sum())
    assert (result.count, result.samples) == (6, 6)
    engine.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny in-process run (2 epochs of 4 steps, a log line every 2, channels-last forced on
    the CPU) with every read of a tensor's value made from rptrain/train/ or rptrain/data/ recorded, by the step
    after which it happened."""
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "trainer.epochs=2", "trainer.log_interval=2", "trainer.progress=false",
                                            "engine.channels_last=true"])
    run_dir = tmp_path_factory.mktemp("run")
    reads: list[tuple[int, str]] = []
    steps: list[tuple[float, int, int, int]] = []  # per step: mean loss, count, correct, samples
    patch = pytest.MonkeyPatch()

    def counting(owner, name):
        original = getattr(owner, name)

        def read(*args, **kwargs):
            caller = sys._getframe(1).f_code
            # (finite_step's check of the loss runs on the optimizer thread on a GPU: not the loop's wait)
            if caller.co_filename.startswith(LOOP_DIRS) and "finite_step" not in caller.co_qualname:
                reads.append((len(steps), name))
            return original(*args, **kwargs)

        return read

    original_step = ImageTask.train_step

    def train_step(self, *args, **kwargs):
        r = original_step(self, *args, **kwargs)
        # The old per-step computation, here (this file's reads are not counted).
        steps.append((r.loss.item() * r.loss_factor, r.count, sum(int(c.item()) for c in r.correct), r.samples))
        benchmark.add(torch.backends.cudnn.benchmark)
        frozen.append(gc.get_freeze_count())
        return r

    for name in READS:
        patch.setattr(torch.Tensor, name, counting(torch.Tensor, name))
    patch.setattr(torch.cuda, "synchronize", counting(torch.cuda, "synchronize"))  # (GPU runs) an explicit wait counts too
    patch.setattr(ImageTask, "train_step", train_step)
    formats, benchmark, frozen = [], set(), []
    patch.setattr(setup, "RoundPipe", lambda *a, **kw: formats.append(kw["memory_format"]) or RoundPipe(*a, **kw))
    try:
        trainer = Trainer(cfg, run_dir, [], Console(quiet=True), "")
        summary = trainer.fit(StopRequest())
        summary.update(frozen_during_steps=frozen, frozen_after=gc.get_freeze_count())
    finally:
        patch.undo()
    assert formats == [torch.channels_last]
    # engine.cudnn_benchmark (default true) holds while the run trains, and the process's setting after it.
    assert benchmark == {True} and torch.backends.cudnn.benchmark is False
    return read_jsonl(run_dir / "metrics.jsonl"), reads, steps, summary


def test_no_read_between_log_steps(run):
    records, reads, steps, summary = run
    assert summary["steps"] == len(steps) == 8
    after = {step for step, _ in reads}
    # Reads happen only after log steps (2, 4, 6, 8; epochs end at 4 and 8), and after step 1 for the
    # first line a run off a terminal prints (a heartbeat, then at most one every 30 s), never inside a step.
    assert after <= {1, 2, 4, 6, 8}, reads
    assert after >= {2, 6}  # the log steps do read (the test sees them)


def test_logged_metrics_equal_the_per_step_numbers(run):
    records, _, steps, _ = run
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    for r in train:
        window = steps[r["step"] - 2 : r["step"]]
        count = sum(c for _, c, _, _ in window)
        assert r["loss"] == pytest.approx(sum(loss * c for loss, c, _, _ in window) / count, rel=1e-12)
        assert r["acc"] == sum(k for _, _, k, _ in window) / sum(s for _, _, _, s in window)
    epochs = [r for r in records if r["kind"] == "epoch"]
    for r, window in zip(epochs, (steps[:4], steps[4:])):
        assert r["train_loss"] == pytest.approx(sum(loss * c for loss, c, _, _ in window) / sum(c for _, c, _, _ in window), rel=1e-12)
        assert r["train_acc"] == sum(k for _, _, k, _ in window) / sum(s for _, _, _, s in window)


def test_epoch_throughput_counts_the_evaluation(run):
    records, _, _, _ = run
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(epochs) == 2
    for r in epochs:
        # The wall clock spans the steps and the evaluation after them.
        assert r["epoch_wall_time"] > r["epoch_time"] > 0
        assert r["epoch_samples_per_s"] == pytest.approx(64 / r["epoch_wall_time"])
    # Each epoch's evaluation is timed, and the epoch's wall clock holds it.
    evals = {r["epoch"]: r["eval_time"] for r in records if r["kind"] == "eval"}
    assert set(evals) == {1, 2} and all(0 < evals[r["epoch"]] < r["epoch_wall_time"] for r in epochs)
    # A log window's wall clock per step holds its data and step times (and the loop's own work besides).
    for r in (r for r in records if r["kind"] == "train"):
        assert r["step_wall_time"] >= r["data_time"] + r["step_time"] > 0


def test_objects_made_before_training_stay_out_of_its_garbage_collections(run):
    """Trainer.fit freezes what its setup left (a full collection over them paused a CPU run's epoch for 0.2 s)
    and unfreezes it at cleanup, so a sweep's next job in this process can collect the last one's."""
    summary = run[3]
    assert min(summary["frozen_during_steps"]) > 10_000  # torch's and the CLI's modules, the model, the config
    assert summary["frozen_after"] == 0


def test_channels_last_choice():
    """engine.channels_last: null turns it on for convolution models computing on CUDA only."""
    conv, mlp = tiny_resnet(), torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert choose_memory_format(None, conv, ["cuda:0"]) is torch.channels_last
    assert choose_memory_format(None, conv, ["cpu"]) is None and choose_memory_format(None, mlp, ["cuda:0"]) is None
    assert choose_memory_format(None, conv, None) is (torch.channels_last if torch.cuda.is_available() else None)
    assert choose_memory_format(True, mlp, ["cpu"]) is torch.channels_last and choose_memory_format(False, conv, ["cuda:0"]) is None


def test_meter_folds_long_spans_without_reading(monkeypatch):
    """Past FOLD_STEPS pending steps a Meter adds them up on the device: memory stays bounded, no
    read happens before settle(), and the sums are the per-step ones (float64, rel 1e-12)."""
    monkeypatch.setattr(meters, "FOLD_STEPS", 4)
    g = torch.Generator().manual_seed(0)
    steps = [StepResult(torch.rand((), generator=g), 0.5, 8, [torch.tensor(i), torch.tensor(1)], 8) for i in range(10)]
    expected = sum(r.loss.double().item() * 0.5 for r in steps) / 10
    m = meters.Meter()
    reads = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or torch.Tensor.tolist(self))
    for r in steps:
        m.add(r, 0.0, 0.0)
        assert len(m._losses) <= 4 and not reads
    assert m.mean_loss() == pytest.approx(expected, rel=1e-12)
    assert m.correct == sum(range(10)) + 10 and len(reads) == 2


@pytest.mark.parametrize("eval_microbatch", [None, 1, 3])
def test_image_evaluation_matches_plain_pytorch(eval_microbatch):
    """trainer.eval_num_microbatch: an evaluation batch runs as that many microbatches (None: the
    training count, 2 here) with the same loss and accuracy as the whole model in plain PyTorch
    (eval-mode BatchNorm does not depend on the split); fp32, tolerance 1e-5, exact count."""
    model, reference = tiny_resnet(), tiny_resnet()
    engine = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    task = ImageTask(2, torch.float32, eval_microbatch=eval_microbatch)
    calls = []
    engine_call = engine.forward
    engine.forward = lambda *a, run_config=None, **kw: calls.append(run_config.num_microbatch) or engine_call(*a, run_config=run_config, **kw)
    batches = [(torch.randn(6, 3, 8, 8), torch.randint(0, 10, (6,))), (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))]
    engine.eval()
    with torch.no_grad():
        result = task.evaluate(engine, batches)
        reference.to(engine.devices[0]).eval()  # the reference computes where the engine does
        logits = torch.cat([reference(x.to(engine.devices[0])) for x, _ in batches]).cpu()
    labels = torch.cat([y for _, y in batches])
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert result["acc"] == (logits.argmax(1) == labels).float().mean().item()
    assert calls == ([None, None] if eval_microbatch is None else [min(eval_microbatch, 6), min(eval_microbatch, 2)])
    engine.close()


def test_cudnn_searches_only_for_the_usual_training_batch():
    """engine.cudnn_benchmark: the search runs for the shapes that repeat every step, not for an epoch's last,
    smaller batch nor for the evaluation (3.5 s of the main job's first epoch on an H100, train/kernels.py)."""
    from rptrain.train.kernels import CudnnSearch

    before = torch.backends.cudnn.benchmark
    try:
        search = CudnnSearch(True, 16)
        for rows, expected in ((16, True), (16, True), (8, False), (16, True)):
            search.training((torch.zeros(rows, 3, 4, 4), torch.zeros(rows, dtype=torch.long)))
            assert torch.backends.cudnn.benchmark is expected, rows
        search.evaluating()
        assert torch.backends.cudnn.benchmark is False
        search.training({"input_ids": torch.zeros(16, 5, dtype=torch.long)})
        assert torch.backends.cudnn.benchmark is True
        off = CudnnSearch(False, 16)
        off.training((torch.zeros(16, 3),))
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before

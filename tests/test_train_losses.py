"""Every place a loss or metric crosses microbatches, against one unsplit batch.

Training (the engine's returned loss, the step's mean and its gradients), evaluation, images and
tokens, masked tokens (a token-weighted mean whatever the microbatches' counts of trained tokens),
and the meters that add steps of different token counts. fp32 on the CPU: rel 1e-5 (the split only
changes the order of the float sums).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rptrain import GradScaler, OptimizerCtx, RoundPipe
from rptrain.models import IGNORE_INDEX, build_model, count_tokens
from rptrain.optim import Adam
from rptrain.train.meters import Meter
from rptrain.train.tasks import ImageTask, LanguageTask, StepResult

REL = 1e-5


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return build_model("llama_tiny", vocab_size=64, loss_chunk_tokens=16)


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return build_model("resnet18", num_classes=5, widths=[4, 8, 8, 8], stem_channels=4)


def token_batch() -> tuple:
    """6 rows of 12 tokens; rows 0-1 train 11 tokens each, rows 2-5 one or two: microbatches of 2 rows
    hold 22, 3 and 4 trained tokens, so a mean of microbatch means would be far off the token mean."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (6, 12), generator=g)
    targets = torch.randint(0, 64, (6, 12), generator=g)
    targets[2:, :-2] = IGNORE_INDEX
    targets[3, -1] = IGNORE_INDEX
    return ids, targets


def reference_token_loss(model, batch) -> tuple[float, dict]:
    """Plain PyTorch, one batch: the mean loss over trained tokens and every gradient."""
    model = copy.deepcopy(model)
    loss = model(tuple(batch)) / count_tokens(batch[1])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def engine_step(task, model, batch) -> tuple[float, dict]:
    """The task's train_step through the engine: (the batch's mean loss, the gradients the optimizer sees)."""
    engine = RoundPipe(copy.deepcopy(model))
    with OptimizerCtx():
        params = dict(engine.named_parameters())
        Adam(params.values(), lr=1e-3)
    grads = {}
    result = task.train_step(engine, batch, GradScaler(enabled=False))
    engine.step(lambda: grads.update({k: p.grad.clone() for k, p in params.items()}), is_async=False)
    engine.close()
    return result.loss.item() * result.loss_factor, grads


@pytest.mark.parametrize("micro", [2, 3])
def test_token_training_loss_and_gradients_match_one_batch(llama, micro):
    batch = token_batch()
    want_loss, want_grads = reference_token_loss(llama, batch)
    loss, grads = engine_step(LanguageTask(micro, torch.float32), llama, batch)
    assert loss == pytest.approx(want_loss, rel=REL)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=REL, atol=1e-7, msg=name)


def test_token_evaluation_does_not_depend_on_the_microbatches(llama):
    """The issue's bug: 0-d summed losses were merged by their mean, dividing by the microbatch count."""
    batch = token_batch()
    want, _ = reference_token_loss(llama, batch)
    engine = RoundPipe(copy.deepcopy(llama))
    try:
        with torch.no_grad():
            for micro in (1, 2, 3, 6):
                got = LanguageTask(1, torch.float32, eval_microbatch=micro).evaluate(engine, [batch, batch])
                assert got["loss"] == pytest.approx(want, rel=REL), micro
    finally:
        engine.close()


def image_batch() -> tuple:
    g = torch.Generator().manual_seed(2)
    return torch.randn(7, 3, 16, 16, generator=g), torch.randint(0, 5, (7,), generator=g)


def test_image_training_and_evaluation_match_one_batch(resnet):
    images, labels = image_batch()
    model = copy.deepcopy(resnet).eval()  # BatchNorm's batch statistics would differ per microbatch
    logits = model(images)
    want_loss = F.cross_entropy(logits, labels).item()
    want_acc = (logits.argmax(1) == labels).float().mean().item()
    engine = RoundPipe(copy.deepcopy(resnet))
    engine.eval()
    try:
        with OptimizerCtx():
            Adam(engine.parameters(), lr=1e-3)
        result = ImageTask(3, torch.float32).train_step(engine, (images, labels), GradScaler(enabled=False))
        assert result.loss.item() * result.loss_factor == pytest.approx(want_loss, rel=REL)
        assert sum(int(c) for c in result.correct) / result.samples == pytest.approx(want_acc)
        engine.step(lambda: None, is_async=False)  # the accumulated gradients are released
        with torch.no_grad():
            got = ImageTask(1, torch.float32, eval_microbatch=3).evaluate(engine, [(images, labels)])
        assert got["loss"] == pytest.approx(want_loss, rel=REL) and got["acc"] == pytest.approx(want_acc)
    finally:
        engine.close()


def test_meters_weight_each_step_by_its_trained_tokens():
    """Two steps with 30 and 2 trained tokens: the window's loss is the token mean, not the mean of step means."""
    meter = Meter()
    meter.add(StepResult(torch.tensor(1.0), 1.0, 30, [], 4), 0.0, 0.0)
    meter.add(StepResult(torch.tensor(4.0), 1.0, 2, [], 4), 0.0, 0.0)
    assert meter.mean_loss() == pytest.approx((1.0 * 30 + 4.0 * 2) / 32)


def test_the_cli_reports_one_test_loss_whatever_the_evaluation_microbatches(tmp_path):
    """The issue's command, as a -m sweep over trainer.eval_num_microbatch: every job's test_loss (what
    summary.json, the sweep table and a sweeper's objective read) is the same."""
    import json

    from test_cli_helpers import explain, rptrain_here

    sweep = tmp_path / "sweep"
    proc = rptrain_here(["-m", "model=llama_tiny", "data=synthetic_tokens", "data.num_train=64", "data.num_val=16", "data.seq_len=32",
                         "trainer.max_steps=4", "trainer.batch_size=8", "run_config.num_microbatch=2", "trainer.eval_num_microbatch=1,2",
                         "trainer.hf_export=false", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    losses = [row["test_loss"] for row in json.loads((sweep / "sweep_summary.json").read_text())]
    assert len(losses) == 2 and losses[1] == pytest.approx(losses[0], rel=REL), losses

"""metrics.jsonl / metrics.csv and the curves plot."""
from __future__ import annotations

import csv
import json
import math

from rptrain.train.metrics import MetricsLog
from rptrain.train.plots import plot_curves


def test_jsonl_csv_and_history(tmp_path):
    log = MetricsLog(tmp_path)
    log.add("train", step=1, epoch=1, loss=2.5, acc=0.1, lr=1e-3, loss_scale=65536.0, samples_per_s=100.0)
    log.add("eval", step=1, epoch=1, loss=float("nan"), acc=0.2)
    log.write_csv()
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "train" and lines[0]["loss_scale"] == 65536.0
    assert lines[1]["loss"] is None  # NaN is not JSON
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["loss"] == "2.5" and rows[1]["kind"] == "eval" and rows[1]["lr"] == ""

    # A resumed run starts from the checkpoint's history and appends to it.
    resumed = MetricsLog(tmp_path, history=lines[:1])
    resumed.add("train", step=2, epoch=1, loss=2.0)
    resumed.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_curves_per_step_then_per_epoch(tmp_path):
    steps = [{"kind": "train", "step": s, "loss": 3 - 0.1 * s, "acc": 0.1 * s} for s in range(1, 5)]
    steps.append({"kind": "eval", "step": 4, "loss": 2.8, "acc": 0.2})
    plot_curves(steps, tmp_path / "a.png")
    epochs = [{"kind": "epoch", "epoch": e, "train_loss": 2 / e, "train_ppl": math.exp(2 / e), "test_loss": 2.1 / e,
               "test_ppl": math.exp(2.1 / e)} for e in (1, 2)]
    plot_curves(steps + epochs, tmp_path / "b.png", metric="ppl")
    for name in ("a.png", "b.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png"]


def test_curves_are_redrawn_at_an_epoch_end_only_after_a_while_and_always_at_the_end(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from rptrain.train import report as report_module
    from rptrain.train.dist import Dist

    drawn = []
    monkeypatch.setattr(report_module, "plot_curves", lambda records, path, metric: drawn.append(len(records)))
    clock = [100.0]
    monkeypatch.setattr(report_module.time, "monotonic", lambda: clock[0])
    log = MetricsLog(tmp_path)
    report = report_module.Report(None, Dist(), log, SimpleNamespace(metric="acc"), tmp_path, 10, 10)
    for epoch in range(3):  # three epochs of 1 s: drawn at the first only
        log.add("epoch", epoch=epoch + 1, train_loss=1.0)
        report.write_files(every_s=report_module.PLOT_EVERY_S)
        clock[0] += 1.0
    clock[0] += report_module.PLOT_EVERY_S
    report.write_files(every_s=report_module.PLOT_EVERY_S)  # long enough since: drawn
    report.write_files()  # the run's end: always
    report.write_files(plot=False)  # a stop: never
    log.close()
    assert drawn == [1, 3, 3] and (tmp_path / "metrics.csv").is_file()

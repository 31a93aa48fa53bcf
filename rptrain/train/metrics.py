"""metrics.jsonl (a line per log step, evaluation and epoch) and metrics.csv in the run directory.

The full history also travels in every checkpoint, so a resumed run rewrites the files from it
and its run directory holds the whole run, not just the part after the resume.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

# CSV column order; records only carry the keys that apply to them.
COLUMNS = (
    "kind", "step", "epoch", "loss", "acc", "ppl", "lr", "loss_scale", "samples_per_s", "tokens_per_s",
    "data_time", "step_time", "step_wall_time", "train_loss", "train_acc", "train_ppl", "test_loss", "test_acc", "test_ppl",
    "eval_time", "epoch_time", "epoch_wall_time", "epoch_samples_per_s", "time",
)


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """run_dir None (the other ranks of a torchrun job): the records are kept, nothing is written."""

    def __init__(self, run_dir: Optional[Path], history: Optional[Iterable[dict]] = None,
                 on_add: Optional[Callable[[dict], None]] = None) -> None:
        self.records: list[dict] = [dict(r) for r in history or ()]
        self.on_add = on_add  # the experiment trackers (loggers.py): each new record, not the history
        self._file = None
        if run_dir is None:
            return
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        self.csv = Path(run_dir) / "metrics.csv"
        with self.jsonl.open("w") as f:  # a resumed run starts from the checkpoint's history
            for record in self.records:
                f.write(json.dumps(record) + "\n")
        self._file = self.jsonl.open("a", buffering=1)  # line-buffered: tail -f works

    def add(self, kind: str, **values: Any) -> dict:
        record = {"kind": kind, **{k: _clean(v) for k, v in values.items()}}
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self.on_add is not None:
            self.on_add(record)
        return record

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]

    def write_csv(self) -> None:
        if self._file is None:
            return
        extra = sorted({k for r in self.records for k in r} - set(COLUMNS))
        tmp = self.csv.with_name(f".{self.csv.name}.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *extra], restval="")
            writer.writeheader()
            writer.writerows(self.records)
        tmp.replace(self.csv)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

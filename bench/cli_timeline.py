"""Issue 33's slow log window: the CLI's main job with one timeline of what happens while it trains.

The CLI (``rptrain model=resnet34 data=synthetic data.num_train=25600 trainer.epochs=3
trainer.log_interval=25``, plus any overrides given) runs in a child process with hooks that note, on one clock:
every log window's end, every garbage-collection pass of the oldest generation or longer than 1 ms (and its
thread), each checkpoint write's start and end (and its thread: a background write runs on
``rptrain-checkpoint``) with its parts (snapshot, shards, checksum, manifest, fsync; ``phase`` events), every step slower than ``--slow-ms`` on the wall clock, and every metrics write
slower than 0.5 ms. With a background checkpoint's log window 1.4 ms a step slower than the others (H100,
2026-12-07; gone with ``trainer.checkpoint_interval=1000000``), this says which of those the slow steps
sit beside. Prints one JSON line per event (``t_ms`` from the child's start) and one per log window of the
last two epochs. ``--tiny`` (CI): narrow ResNet-34, 640 images.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import emit, parser

ROOT = Path(__file__).resolve().parent.parent

# Run in the child before the CLI: wraps the places named above and writes the events to $TIMELINE at exit.
HOOKS = r"""
import atexit, gc, json, os, runpy, sys, threading, time
t0, events, started, last_step = time.perf_counter(), [], {}, [None]
slow_s = float(os.environ["TIMELINE_SLOW_MS"]) / 1e3
def note(event, **fields):
    events.append(dict(t_ms=round(1e3 * (time.perf_counter() - t0), 1), event=event, thread=threading.current_thread().name, **fields))
def on_gc(phase, info):
    key = threading.get_ident()
    if phase == "start":
        started[key] = time.perf_counter()
    elif key in started:
        ms = 1e3 * (time.perf_counter() - started.pop(key))
        if info["generation"] == 2 or ms > 1:
            note("gc", generation=info["generation"], ms=round(ms, 2), collected=info["collected"])
gc.callbacks.append(on_gc)
import rptrain.train.metrics as metrics, rptrain.train.report as report, rptrain.train.run_checkpoints as run_checkpoints
save = run_checkpoints.save_rotating
def timed_save(*args, **kwargs):
    note("checkpoint_write_start")
    try:
        return save(*args, **kwargs)
    finally:
        note("checkpoint_write_end")
run_checkpoints.save_rotating = timed_save
log_step = report.Report.log_step
def timed_log_step(self, p, *args, **kwargs):
    note("log_window_end", step=p.step)
    return log_step(self, p, *args, **kwargs)
report.Report.log_step = timed_log_step
add_step = report.Report.add_step
def timed_add_step(self, p, result, data_s, step_s, skipped):
    now = time.perf_counter()
    if last_step[0] is not None and now - last_step[0] > slow_s:
        note("slow_step", step=p.step + 1, wall_ms=round(1e3 * (now - last_step[0]), 2), data_ms=round(1e3 * data_s, 2), step_ms=round(1e3 * step_s, 2))
    last_step[0] = now
    return add_step(self, p, result, data_s, step_s, skipped)
report.Report.add_step = timed_add_step
add = metrics.MetricsLog.add
def timed_add(self, kind, **values):
    start = time.perf_counter()
    record = add(self, kind, **values)
    ms = 1e3 * (time.perf_counter() - start)
    if ms > 0.5:
        note("slow_metrics_write", kind=kind, ms=round(ms, 2))
    return record
metrics.MetricsLog.add = timed_add
def phase(owner, name, label):  # the checkpoint's parts, on both threads: where within the write the slow steps fall
    fn = getattr(owner, name)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ms = 1e3 * (time.perf_counter() - start)
            if ms > 0.2:
                note("phase", name=label, start_ms=round(1e3 * (start - t0), 1), ms=round(ms, 2))
    setattr(owner, name, timed)
import rptrain.train.checkpoint as checkpoint, rptrain.train.checkpoint_layout as layout, rptrain.train.loop as loop
for owner, name in [(run_checkpoints, "snapshot"), (run_checkpoints, "state_nbytes"), (layout, "unique_tensors"), (layout, "write_shards"),
                    (checkpoint, "checksum"), (layout, "write_manifest"), (layout, "drop_written"), (os, "fsync"), (os, "replace"),
                    (metrics.MetricsLog, "write_csv"), (loop.Trainer, "_evaluate"), (loop.Trainer, "_checkpoint"),
                    (report.Report, "end_epoch"), (report.Report, "evaluated")]:
    phase(owner, name, name)
if os.environ.get("TIMELINE_FORGET_SHARDS"):  # the write as it was before the manifests' shard names were remembered
    checkpoint._remember_shard_names = lambda key, names: None
if os.environ.get("TIMELINE_SWITCH_MS"):  # a shorter GIL switch interval: do the slow steps wait for the GIL?
    sys.setswitchinterval(float(os.environ["TIMELINE_SWITCH_MS"]) / 1e3)
atexit.register(lambda: open(os.environ["TIMELINE"], "w").write(json.dumps(events)))
sys.argv = ["rptrain", *sys.argv[1:]]
runpy.run_module("rptrain.cli.main", run_name="__main__")
"""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--slow-ms", type=float, default=5.0, help="a step slower than this on the wall clock is an event (3.6 ms is the H100's)")
    p.add_argument("--switch-ms", type=float, help="the child's GIL switch interval (sys.setswitchinterval; Python's default 5 ms)")
    p.add_argument("--forget-shards", action="store_true", help="re-read every manifest each save (checkpoint.py before 7b0dee2)")
    p.add_argument("overrides", nargs="*", help="more CLI overrides, e.g. trainer.checkpoint_interval=1000000")
    args = p.parse_args()
    size = (["model.widths=[8,16,32,64]", "model.stem_channels=8", "data.num_train=640", "data.num_test=128", "trainer.log_interval=5"]
            if args.tiny else ["data.num_train=25600", "data.num_test=2000", "trainer.log_interval=25"])
    slow_ms = 1e9 if args.tiny else args.slow_ms  # a CPU's every step is slow: CI checks the hooks, not the steps
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, events_file = Path(tmp) / "run", Path(tmp) / "events.json"
        cli = ["model=resnet34", "data=synthetic", "trainer.epochs=3", "trainer.progress=false", *size,
               f"hydra.run.dir={run_dir}", *args.overrides]
        env = {**os.environ, "TIMELINE": str(events_file), "TIMELINE_SLOW_MS": str(slow_ms),
               **({"TIMELINE_SWITCH_MS": str(args.switch_ms)} if args.switch_ms else {}),
               **({"TIMELINE_FORGET_SHARDS": "1"} if args.forget_shards else {}),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        child = subprocess.run([sys.executable, "-c", HOOKS, *cli], env=env, capture_output=True, text=True, timeout=900)
        if child.returncode != 0:
            emit(bench="cli_timeline", error=f"the CLI exited with {child.returncode}: {child.stderr.strip()[-300:]}")
            sys.exit(1)
        for event in json.loads(events_file.read_text()):
            emit(bench="cli_timeline", **event)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for r in records:
            if r["kind"] == "train" and r["epoch"] >= 2:
                emit(bench="cli_timeline_window", epoch=r["epoch"], step=r["step"], wall_ms=round(1e3 * r["step_wall_time"], 3),
                     step_ms=round(1e3 * r["step_time"], 3))


if __name__ == "__main__":
    main()

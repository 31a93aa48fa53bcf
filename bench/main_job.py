"""The README's main job end to end: ``rptrain model=resnet34 data=cifar100``, from the command to its summary.

The machine that measures has no internet, so a CIFAR-100 folder is written first in the real on-disk
format (the tests' writer: protocol-2 pickles, 50,000 training and 10,000 test images of random
class-coloured content), and the command reads it with ``data.download=false
data.verify_checksums=false``, everything else at its defaults (20 epochs, batch 128, evaluation every
epoch, a checkpoint every epoch). Prints one JSON line: the wall time from the command's start to its
exit, where it went (``phases``, from the run log's timestamps), and the run's own summary (test accuracy is meaningless on
random images). ``--tiny`` (CI): a small ResNet-18, 64 images, one epoch.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit, parser

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "tests"))
from cifar_fixture import write_fake_cifar  # noqa: E402  (the real format's writer lives with the tests)

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")


FIRST_STEP = re.compile(r"Epoch 1/\d+: ")


def stamped(log: str) -> list[tuple[float, str]]:
    """The run log's timestamped lines (millisecond resolution, local time) as (seconds, line)."""
    out = []
    for line in log.splitlines():
        m = STAMP.match(line)
        if m:
            out.append((time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000, line))
    return out


def phases(stamps: list[tuple[float, str]], started: float, ended: float) -> dict[str, float]:
    """Where the wall time went, from the run log's ``stamped`` lines.

    to_log: imports and Hydra before the first log line; setup: the first line to the first step's
    line (model, data, engine); first_epoch: the first step's line to the first epoch's end; epochs: the
    rest of the epochs; end: the last epoch's line to ``done``; exit: ``done`` to the process's exit.
    """
    if not stamps:
        return {}
    first_step = next((t for t, line in stamps if FIRST_STEP.search(line)), stamps[0][0])
    epoch_ends = [t for t, line in stamps if re.search(r"Epoch \d+/\d+ took", line)]
    done = next((t for t, line in stamps if "] done: " in line), stamps[-1][0])
    out = {"to_log": stamps[0][0] - started, "setup": first_step - stamps[0][0]}
    if epoch_ends:
        out |= {"first_epoch": epoch_ends[0] - first_step, "epochs": epoch_ends[-1] - epoch_ends[0], "end": done - epoch_ends[-1]}
    out["exit"] = ended - done
    return {k: round(v, 2) for k, v in out.items()}


def setup_steps(stamps: list[tuple[float, str]]) -> list[list]:
    """The setup's ``stamped`` lines up to the first step's, each as [seconds since the line before, its first
    words]: which part of the setup (model and data, engine, optimizer and checkpoint check, first step) took the time."""
    out, before = [], None
    for t, line in stamps:
        out.append([round(t - before, 2) if before is not None else 0.0, line.split("] ", 1)[-1][:48]])
        before = t
        if FIRST_STEP.search(line):
            break
    return out


def windows(records: list[dict], epoch: int) -> list[dict]:
    """The epoch's train records, each with ``_steps``: the steps its window covered."""
    out, before = [], 0
    for r in records:
        if r.get("kind") == "train" and r["epoch"] == epoch:
            out.append({**r, "_steps": r["step"] - before})
        if r.get("kind") == "train":
            before = r["step"]
    return out


# --stacks: every thread's Python stack sampled at a fixed interval while the command sets up (a sampling
# profiler that sees the engine's worker threads too, which cProfile does not)
SAMPLED = """import runpy, sys, threading, time, traceback
every, until, path = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
def sample():
    me, end = threading.get_ident(), time.monotonic() + until
    with open(path, "w") as out:
        while time.monotonic() < end:
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    out.write("Thread\\n" + "".join(reversed(traceback.format_stack(frame))))
            out.flush()  # a daemon thread: the process may end at any sample
            time.sleep(every)
threading.Thread(target=sample, daemon=True).start()
sys.argv = ["rptrain", *sys.argv[4:]]
runpy.run_module("rptrain.cli.main", run_name="__main__", alter_sys=True)
"""
IDLE = (" in wait", " in get", " in _wait_for_tstate_lock", " in select", " in accept", " in poll", " in _worker")


def _short(frame: str) -> str:
    """'File "/x/rptrain/engine/a.py" line 3 in f' -> 'engine/a.py:3 f' (outside rptrain: the file's name alone)"""
    m = re.match(r'File "(.*)" line (\d+) in (.*)', frame)
    if not m:
        return frame
    path = m.group(1)
    where = path.split("/rptrain/", 1)[1] if "/rptrain/" in path else path.rsplit("/", 1)[-1]
    return f"{where}:{m.group(2)} {m.group(3)}"


def hot_frames(dump: str, top: int = 12) -> list[list]:
    """The sampled stacks' busiest places: per thread sample, its innermost frame and the innermost rptrain
    frame above it, counted; threads waiting on a lock, queue or socket are left out."""
    counts: dict[str, int] = {}
    for stack in dump.split("Thread\n")[1:]:
        frames = [line.strip().replace(",", "") for line in stack.splitlines() if line.strip().startswith("File ")]
        if not frames or any(frames[0].endswith(idle) for idle in IDLE):
            continue
        ours = next((f for f in frames if "/rptrain/" in f), "")
        key = f"{_short(frames[0])} <- {_short(ours)}"
        counts[key] = counts.get(key, 0) + 1
    return [[n, k] for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]


TINY = ["model=resnet18", "model.widths=[8,16,32,64]", "model.stem_channels=8", "trainer.batch_size=16"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--num-train", type=int, default=50000)
    p.add_argument("--num-test", type=int, default=10000)
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--stacks", type=float, default=0.0, metavar="SECONDS",
                   help="sample every thread's stack this often during the first --stacks-for seconds (hot_frames)")
    p.add_argument("--stacks-for", type=float, default=30.0)
    p.add_argument("overrides", nargs="*", help="extra overrides for the command (e.g. engine.compile=true)")
    args = p.parse_args()
    if args.tiny:
        args.epochs, args.num_train, args.num_test = 1, 64, 32
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        data = write_fake_cifar(Path(tmp) / "data", "cifar100", n_train=args.num_train, n_test=args.num_test)
        written_s = time.perf_counter() - start
        run_dir = Path(tmp) / "run"
        dump = Path(tmp) / "stacks.txt"
        runner = (["-c", SAMPLED, str(args.stacks), str(args.stacks_for), str(dump)] if args.stacks else ["-m", "rptrain.cli.main"])
        argv = [sys.executable, *runner, "model=resnet34", "data=cifar100", f"data.root={data}",
                "data.download=false", "data.verify_checksums=false", f"trainer.epochs={args.epochs}", "trainer.progress=false",
                f"hydra.run.dir={run_dir}", *(TINY if args.tiny else []), *args.overrides]
        start, started = time.perf_counter(), time.time()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, cwd=tmp)
        wall_s, ended = time.perf_counter() - start, time.time()
        if proc.returncode != 0:
            emit(bench="main_job", error=f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
            return
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        epochs = [r for r in records if r.get("kind") == "epoch"]
        stamps = stamped((run_dir / "rptrain.log").read_text())
        spent, setup = phases(stamps, started, ended), setup_steps(stamps)
        hot = hot_frames(dump.read_text(errors="replace")) if args.stacks else None
    emit(bench="main_job", device=args.device, epochs=args.epochs, num_train=args.num_train, num_test=args.num_test,
         overrides=" ".join(args.overrides), dataset_written_s=round(written_s, 1), wall_s=round(wall_s, 2), phases_s=spent, setup_lines_s=setup,
         epoch_wall_s=[round(r["epoch_wall_time"], 2) for r in epochs],
         # where the first epoch's extra time goes: its log windows (seconds each, on the wall clock) and every evaluation
         first_epoch_windows_s=[round(r["step_wall_time"] * r["_steps"], 2) for r in windows(records, 1)],
         eval_s=[round(r["eval_time"], 3) for r in records if r.get("kind") == "eval"],
         steady_epoch_samples_per_s=round(epochs[-1]["epoch_samples_per_s"], 1) if epochs else None,
         summary={k: v for k, v in summary.items() if isinstance(v, (int, float, str))},
         **({"hot_frames": hot} if hot is not None else {}))


if __name__ == "__main__":
    main()

"""Issue 32's 8 B end of a run and issue 29's start-up: one `rptrain` command in a child process, its host
memory sampled from outside, and one JSON line about it.

    python3 bench/endrun.py --model hf --folder /tmp/llama-3.1-8b --optim adamw_lowmem     # to the end
    python3 bench/endrun.py --model llama_8b --optim adamw_lowmem --until first_step      # start-up only

The command is ``rptrain model=... data=synthetic_tokens`` at 4 x 4096 (bf16 compute) for ``--steps`` steps,
then its end: the final evaluation, checkpoint and Hugging Face export. ``--until first_step`` kills the
process group after the first step's line (nothing is saved). Every ``--interval`` seconds the sampler
reads the process tree's resident memory (/proc/PID/status: RssAnon, RssFile, RssShmem), the machine's
MemAvailable (its lowest) and its dirty and writeback pages (their peak: writes waiting in memory); a peak is
kept per phase:

    setup       the command's start to the first step's line (time_to_first_step_s)
    train       to the last step's line
    eval        to the first file in checkpoints/ (the final evaluation)
    checkpoint  to hf/ appearing
    export      to the exit

``peak_rss_gib`` is the child's exact peak resident memory (the kernel's ru_maxrss from wait4). A run the
operating system kills exits -9 with status.json left at ``running``. When the disk cannot hold the
checkpoint and the export (estimated from the folder's size and ``--ckpt-bytes``), the export is left
out (``trainer.hf_export=false``) and the record says so; the run's own disk check still decides.
``--tiny``: a tiny folder and shapes (CI: the script works, it measures nothing).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import emit, meminfo, parser

PHASES = ("setup", "train", "eval", "checkpoint", "export")
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
GIB = 2**30
# Checkpoint bytes per parameter (master + optimizer state, each in its own dtype; disk_check.py's sum):
# fp32 master + two fp32 moments; bf16 master + two int8 moments with an fp32 scale per 64 elements.
CKPT_BYTES = {"adam": 12.0, "adamw": 12.0, "adamw_lowmem": 2 + 2 * (1 + 4 / 64)}


def tree(root: int) -> list[int]:
    """root and its descendants (from /proc/*/stat's parent field)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [root], [root]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def resident(pids: list[int]) -> dict[str, int]:
    """The FIELDS summed over pids, in bytes."""
    total = dict.fromkeys(FIELDS, 0)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in total:
                        total[key] += int(value.split()[0]) * 1024
        except OSError:
            continue
    return total


class Run:
    """The child, its output lines (time-stamped, mirrored to a log) and its phase."""

    def __init__(self, argv: list[str], run_dir: Path, log: Path) -> None:
        self.run_dir, self.start = run_dir, time.perf_counter()
        self.first_step = self.last_step = None
        self.lines: list[str] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)  # its own process group: a kill reaches its children
        self.reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self.reader.start()

    def _read(self, log: Path) -> None:
        with open(log, "a") as out:
            for line in self.proc.stdout:
                now = time.perf_counter() - self.start
                out.write(f"[{now:7.1f}s] {line}")
                out.flush()
                self.lines.append(line.rstrip())
                if line.startswith("step "):
                    done, total = line.split()[1].split("/")
                    self.first_step = self.first_step or now
                    if done == total:
                        self.last_step = now

    def phase(self) -> str:
        if self.first_step is None:
            return "setup"
        if self.last_step is None:
            return "train"
        if not any((self.run_dir / "checkpoints").glob("*")):
            return "eval"
        return "checkpoint" if not (self.run_dir / "hf").exists() else "export"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sample(run: Run, until: str, timeout: float, interval: float, timeline: Path | None) -> tuple[dict, dict, bool]:
    """Sample until the child exits (or its first step, or the timeout); per-phase peaks, the lowest MemAvailable."""
    peaks = {p: dict.fromkeys(FIELDS, 0) for p in PHASES}
    lowest_available, most_dirty, timed_out = meminfo()["MemAvailable"], 0, False
    with open(timeline, "w") if timeline else open(os.devnull, "w") as out:
        while True:
            pid, status, usage = os.wait4(run.proc.pid, os.WNOHANG)  # not Popen.poll: wait4 also gives the peak RSS
            if pid:
                break
            phase, now = run.phase(), time.perf_counter() - run.start
            mem = resident(tree(run.proc.pid))
            machine = meminfo()
            lowest_available = min(lowest_available, machine["MemAvailable"])
            most_dirty = max(most_dirty, machine["Dirty"] + machine["Writeback"])  # written pages not yet on disk
            peaks[phase] = {k: max(peaks[phase][k], mem[k]) for k in FIELDS}
            out.write(json.dumps({"t": round(now, 2), "phase": phase, **{k: round(v / GIB, 3) for k, v in mem.items()}}) + "\n")
            stop = until == "first_step" and run.first_step is not None
            timed_out = now > timeout
            if stop or timed_out:
                run.kill()
                _, status, usage = os.wait4(run.proc.pid, 0)
                break
            time.sleep(interval)
    run.proc.returncode = os.waitstatus_to_exitcode(status)
    run.reader.join(timeout=10)
    totals = {"lowest_mem_available_gib": round(lowest_available / GIB, 2), "peak_dirty_gib": round(most_dirty / GIB, 2),
              "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 2)}
    return peaks, totals, timed_out


def command(args, run_dir: Path) -> tuple[list[str], dict]:
    """The rptrain command line, and what was decided about the export."""
    model = ["model=hf", f"model.path={args.folder}"] if args.model == "hf" else [f"model={'llama_tiny' if args.tiny else args.model}"]
    seq, batch, vocab = (32, 2, 512) if args.tiny else (args.seq, args.batch, 128256)
    argv = [sys.executable, "-m", "rptrain.cli.main", *model, "data=synthetic_tokens", f"data.vocab_size={vocab}",
            f"data.seq_len={seq}", f"data.num_train={batch * args.steps}", f"data.num_val={2 * batch}", f"trainer.batch_size={batch}",
            f"trainer.max_steps={args.steps}", "trainer.log_interval=1", "trainer.progress=false", f"optim={args.optim}",
            f"precision={'fp32' if args.device == 'cpu' else 'bf16'}", f"hydra.run.dir={run_dir}", *args.overrides]
    decided: dict = {}
    if args.until == "end" and args.model == "hf":
        params = json.loads((args.folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"] // 2
        ckpt, export = params * CKPT_BYTES[args.optim], params * 2
        free = shutil.disk_usage(run_dir.parent).free
        decided = {"params": params, "disk_free_gib": round(free / GIB, 2), "ckpt_est_gib": round(ckpt / GIB, 2),
                   "export_est_gib": round(export / GIB, 2)}
        if free < 1.02 * (ckpt + export) and free >= 1.02 * ckpt:
            argv.append("trainer.hf_export=false")
            decided["export_left_out"] = "the disk holds the checkpoint but not the export beside it"
    return argv, decided


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", default="hf", help="hf (with --folder) or a preset (llama_8b)")
    p.add_argument("--folder", type=Path, help="model=hf's folder (bench/hf_folder.py writes one)")
    p.add_argument("--optim", default="adamw_lowmem", choices=sorted(CKPT_BYTES))
    p.add_argument("--until", default="end", choices=["end", "first_step"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/endrun"), help="the run directory's parent (its disk holds the checkpoint)")
    p.add_argument("--log", type=Path, help="the command's output, time-stamped (default: OUT-DIR/NAME.log)")
    p.add_argument("--timeline", type=Path, help="every memory sample as a JSON line")
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("--timeout", type=float, default=480)
    p.add_argument("--keep", action="store_true", help="keep the run directory (default: deleted, freeing its disk)")
    p.add_argument("overrides", nargs="*", help="more rptrain overrides")
    args = p.parse_args()
    if args.model == "hf" and args.folder is None:
        p.error("--model hf needs --folder")
    name = f"{args.model}-{args.optim}-{args.until}"
    run_dir = args.out_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    argv, decided = command(args, run_dir)
    run = Run(argv, run_dir, args.log or args.out_dir / f"{name}.log")
    peaks, totals, timed_out = sample(run, args.until, args.timeout, args.interval, args.timeline)
    status_file = run_dir / "status.json"
    status = json.loads(status_file.read_text())["state"] if status_file.is_file() else None
    sizes = {d: round(sum(f.stat().st_size for f in (run_dir / d).rglob("*") if f.is_file()) / GIB, 2)
             for d in ("checkpoints", "hf") if (run_dir / d).is_dir()}
    emit(bench="endrun", model=args.model, optim=args.optim, until=args.until, steps=args.steps, exit=run.proc.returncode,
         status=status, timed_out=timed_out, wall_s=round(time.perf_counter() - run.start, 1),
         time_to_first_step_s=round(run.first_step, 1) if run.first_step else None,
         last_step_s=round(run.last_step, 1) if run.last_step else None, **totals,
         **{f"{p}_peak_gib": {k.lower(): round(v / GIB, 2) for k, v in peaks[p].items()} for p in PHASES if peaks[p]["VmRSS"]},
         written_gib=sizes, **decided, last_line=next((line for line in reversed(run.lines) if line.strip()), ""),
         command=" ".join(argv[3:]))
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

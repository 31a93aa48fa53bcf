"""Hydra callback: after a -m sweep, one table row per job (sweep_summary.json/.csv + a rich table).

Rows come from each job's summary.json (status.json for jobs that did not finish, with the
one-line reason of a failed one); the overrides column shows what differs between the jobs.
The jobs are found in the sweep folder rather than collected as they end: a launcher such as
submitit runs them in other processes, where this process's callback never hears of them.
A sweep with a failed job ends with one line and exit code 1 once the summary is written.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.table import Table

from .console import make_console
from .dist import other_rank
from .status import read_status, write_json_atomic


# Jobs of this process's sweep whose directory Hydra could not write (cli/hydra_writes.py): they have no folder to be found in.
unwritable_jobs: list[dict] = []


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))  # the launcher's value: ${now:} is resolved once per config
        job_dirs = find_jobs(sweep_dir)
        lost, unwritable_jobs[:] = list(unwritable_jobs), []
        if not (job_dirs or lost) or other_rank():  # under torchrun rank 0 alone writes and prints it
            return
        rows = sorted([job_row(d) for d in job_dirs] + lost, key=lambda r: (not r["job"].isdigit(), int(r["job"]) if r["job"].isdigit() else 0))
        write_sweep_summary(sweep_dir, rows)
        make_console().print(sweep_table(rows))
        make_console().print(f"sweep summary: {sweep_dir / 'sweep_summary.json'}", markup=False)
        failed = [r for r in rows if r["status"] != "completed"]
        if failed:
            first = failed[0]
            reason = f"job {first['job']} {first['status']}" + (f": {first['error']}" if first.get("error") else "")
            print(f"rptrain: error: {len(failed)} of {len(rows)} sweep jobs did not complete ({reason}): see {sweep_dir / 'sweep_summary.json'}",
                  file=sys.stderr, flush=True)
            raise SystemExit(1)  # Hydra turns a callback's Exception into a warning; the exit code must say it


def find_jobs(sweep_dir: Path) -> list[Path]:
    """The job folders of a sweep (each holds Hydra's .hydra/), in job order."""
    jobs = [d for d in sweep_dir.glob("*") if (d / ".hydra").is_dir()]
    return sorted(jobs, key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))


def job_row(job_dir: Path) -> dict:
    try:
        summary = json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):
        status = read_status(job_dir)
        summary = {"status": status.get("state", "unknown"), "overrides": _overrides(job_dir), "error": status.get("error")}
    final = summary.get("final", {})
    return {
        "job": job_dir.name,
        "status": summary.get("status"),
        **({"error": summary["error"]} if summary.get("error") else {}),
        "overrides": list(summary.get("overrides", [])),
        **{k: final.get(k) for k in ("train_loss", "train_acc", "train_ppl", "test_loss", "test_acc", "test_ppl") if k in final},
        "steps": summary.get("steps"),
        "samples_per_s": summary.get("samples_per_s"),
        **({"tokens_per_s": summary["tokens_per_s"]} if "tokens_per_s" in summary else {}),
        "run_dir": str(job_dir),
    }


def _overrides(job_dir: Path) -> list[str]:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"), resolve=False)  # as typed
    except Exception:
        return []


def varying(rows: list[dict]) -> list[list[str]]:
    """Each row's overrides minus those every job shares."""
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    return [[o for o in r["overrides"] if o not in common] for r in rows]


def write_sweep_summary(sweep_dir: Path, rows: list[dict]) -> None:
    write_json_atomic(sweep_dir / "sweep_summary.json", rows)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with (sweep_dir / "sweep_summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows({**r, "overrides": " ".join(r["overrides"])} for r in rows)


def sweep_table(rows: list[dict]) -> Table:
    metrics = [k for k in ("train_loss", "train_acc", "train_ppl", "test_loss", "test_acc", "test_ppl") if any(k in r for r in rows)]
    rate = "tokens_per_s" if any("tokens_per_s" in r for r in rows) else "samples_per_s"
    table = Table(title="sweep summary")
    for name in ("job", "overrides", "status", *metrics, "steps", rate.replace("_per_s", "/s")):
        table.add_column(name, justify="left" if name in ("overrides", "status") else "right")
    for row, changed in zip(rows, varying(rows)):
        status = str(row["status"]) + (f": {row['error'][:80]}" if row.get("error") else "")
        cells = [row["job"], " ".join(changed) or "-", status]
        cells += [_num(row.get(k)) for k in metrics]
        cells += [str(row.get("steps") or "-"), _num(row.get(rate), "{:,.0f}")]
        table.add_row(*cells)
    return table


def _num(value: Any, fmt: str = "{:.4f}") -> str:
    return "-" if value is None else fmt.format(value)

"""status.json in the run directory: running, completed, failed, interrupted or killed.

Tells a finished run from one that died or was stopped: summary.json is only written on
completion, and status.json always says how the run ended (and, when it failed, why). A run the
operating system killed cannot say so itself: its `running` (with the pid, host and start time of
its process) is turned into `killed` by the next run that starts in the same output root
(rundir.mark_killed), which tells a dead run from a live one by the run directory's lock.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written file left behind
        raise


def write_status(run_dir: Path, state: str, **details: Any) -> None:
    path = Path(run_dir) / "status.json"
    text = json.dumps({"state": state, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **details}, indent=2, default=str) + "\n"
    try:
        write_json_atomic(path, json.loads(text))
    except OSError:
        if not path.is_file():
            raise
        # A full disk has no room for a second file, but truncating this one frees its block for the new state:
        # a final status must not stay `running`.
        with open(path, "w") as f:
            f.write(text)


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}

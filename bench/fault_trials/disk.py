"""A full disk (a small tmpfs of a random size, or RLIMIT_FSIZE where mounting is not allowed), a
read-only output and an output path that is a file. Each run completes or stops with one line and a
non-zero exit, a status.json (where one could be written) that is not left ``running``, and every
checkpoint it left verifies."""
from __future__ import annotations

import random
import resource
import subprocess
from pathlib import Path
from typing import Optional

from . import outcome as o
from .kills import broken_checkpoints
from .proc import finish, start, status
from .reference import ARGS


def _mount(point: Path, size_kib: int, read_only: bool = False) -> bool:
    point.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_kib}k" + (",ro" if read_only else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True).returncode == 0


def _umount(point: Path) -> None:
    subprocess.run(["umount", "-l", str(point)], capture_output=True)


def disk_trial(index: int, work: Path, rng: random.Random, case: str) -> o.Trial:
    cwd = work / f"disk-{index}"
    cwd.mkdir()
    mount: Optional[Path] = None
    limit = None
    detail: dict = {}
    if case == "tmpfs_full":
        size = int(rng.choice([16, 64, 256, 1024, 2048, 4096, 8192]) * rng.uniform(0.7, 1.3))
        mount = cwd / "disk"
        if not _mount(mount, size):
            case, mount = "fsize_limit", None  # not allowed here: the process's own file-size limit instead
        else:
            detail["tmpfs_kib"] = size
    if case == "fsize_limit":
        limit = int(rng.uniform(4, 8192) * 1024)
        detail["fsize_bytes"] = limit
    if case == "read_only":
        mount = cwd / "disk"
        if not _mount(mount, 1024, read_only=True):
            mount = None
            (cwd / "disk").chmod(0o555)  # as root this still writes: then the trial shows "completed"
    run_dir = (mount or cwd) / "run"
    if case == "output_is_a_file":
        run_dir.mkdir()
        (run_dir / "checkpoints").write_text("a file where the run's folder goes")
    elif case == "read_only":
        run_dir = cwd / "disk" / "run"

    def limited() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    try:
        proc = start([*ARGS, f"hydra.run.dir={run_dir}", "trainer.hf_export=false"], cwd, preexec_fn=limited)
        code, out, err = finish(proc, 300)
        state = status(run_dir)
        detail.update(exit=code, state=state.get("state"))
        if code is None:
            return o.Trial("disk", case, o.HANG, detail)
        result = o.classify_exit(code, err)
        if result in o.FAILURES:
            detail["stderr"] = err[-600:]
            return o.Trial("disk", case, result, detail)
        if state.get("state") == "running" or (code != 0 and state and state.get("state") != "failed"):
            return o.Trial("disk", case, o.BAD_END, detail)
        bad = broken_checkpoints(run_dir) if run_dir.is_dir() and (run_dir / "checkpoints").is_dir() else []
        if bad:
            detail["broken"] = bad
            return o.Trial("disk", case, o.LOST, detail)
        return o.Trial("disk", case, result, detail)
    finally:
        if mount is not None:
            _umount(mount)

"""Run directories: each run claims its own, and owns it while it runs.

A new run's directory (outputs/DATE/TIME by default) is created with os.mkdir, which fails if it
exists: two runs started in the same second get TIME and TIME-1. The process that runs in a
directory holds a POSIX lock on its `.owner` file (pid, host, start time inside, for people);
the kernel, or the NFS lock manager, drops the lock when the process dies however it dies, so
"is another live run using this directory" is a lock test, not a guess from a pid.

A run directory belongs to one run: the config Hydra stored in its .hydra/config.yaml. Another
config is refused there before anything is written (check_belongs), and so is a fresh start over
this run's checkpoints (trainer.resume=auto continues it). Taking over a directory (resume in
place) removes the temporary files of the run's own writes that were killed midway (by their exact
names: nothing else in the directory is touched), and the checkpoint shards no manifest names. A status.json that says `running` while no process
holds the directory's lock belongs to a run that was killed (kill -9, the kernel's OOM killer, a
machine that went down): every run start marks those under its output_root `killed` (mark_killed),
and its own directory's too (take_over).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from .errors import OutputError
from .status import read_status, write_status

OWNER = ".owner"
_held: dict[Path, int] = {}  # run directories this process owns -> the locked file descriptor


@dataclass
class Place:
    """Where a run (key hydra.run.dir) or a sweep (hydra.sweep.dir) goes."""

    key: str
    path: Path
    how: str  # "new": claim a fresh directory (suffixed if taken); "resume": continue in it; "given": on the command line


class AlreadyCompleted(Exception):
    """trainer.resume=auto found this run finished: there is nothing to do."""

    dist: Optional[Any] = None  # the job's dist settings (preflight sets them): how rank 0 reaches the other ranks


def plan(key: str, directory: Path, given: bool, resumed: Optional[Path]) -> Place:
    """Where a run goes: `resumed` (the run trainer.resume=auto continues) unless the command line gives
    the directory, else `directory` as given or a new one. A resumed run that completed: AlreadyCompleted."""
    if resumed is not None and (not given or Path(resumed) == Path(directory).absolute()):
        status = read_status(resumed)
        if status.get("state") == "completed":
            raise AlreadyCompleted(f"{resumed} already completed this run (step {status.get('step')}): nothing to do")
        if not given:
            return Place(key, Path(resumed), "resume")
    return Place(key, Path(directory), "given" if given else "new")


CLAIMED: set[str] = set()  # overrides added by claim(): not part of the command a user re-runs


def claim(place: Place) -> Optional[str]:
    """Create or own the place; the override that points Hydra at it (None: the command line does already)."""
    path = claim_new(place.path) if place.how == "new" else Path(place.path).absolute()
    own(path)
    if place.how == "given":
        return None
    text = str(path)
    if not re.fullmatch(r"[\w./+-]+", text):  # quoted for Hydra's override parser
        text = "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    CLAIMED.add(f"{place.key}={text}")
    return f"{place.key}={text}"


def claim_new(path: Path) -> Path:
    """Create `path`, or `path-1`, `path-2`, ... if it exists, and own it."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    for i in range(10_000):
        candidate = path if i == 0 else path.with_name(f"{path.name}-{i}")
        try:
            os.mkdir(candidate)
        except FileExistsError:
            continue
        own(candidate)
        return candidate
    raise OutputError(f"{path}: 10,000 run directories of that name exist: choose another hydra.run.dir")


def own(run_dir: Path) -> None:
    """Lock run_dir for this process (a no-op if it already does); OutputError if a live run holds it."""
    run_dir = Path(run_dir).absolute()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / OWNER, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        # EACCES/EAGAIN: another process holds it. Anything else (ENOLCK: no locks here): the pid check decides.
        if err.errno in (errno.EACCES, errno.EAGAIN) or _pid_alive(_read(run_dir)):
            os.close(fd)
            raise _busy(run_dir) from err
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    _held[run_dir] = fd


def release(run_dir: Path) -> None:
    fd = _held.pop(Path(run_dir).absolute(), None)
    if fd is not None:
        os.close(fd)  # drops the lock; the file stays, naming the last owner


def live_owner(run_dir: Path) -> Optional[dict]:
    """The live process (pid, host, started) that owns run_dir, if any; this process counts too."""
    run_dir = Path(run_dir).absolute()
    if run_dir in _held:
        return _read(run_dir)
    try:
        fd = os.open(run_dir / OWNER, os.O_RDONLY)
    except OSError:
        return None  # never owned (an older run) or unreadable: nobody to protect
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return _read(run_dir) or {"pid": "?", "host": "?"}
        return _read(run_dir) if _pid_alive(_read(run_dir)) else None
    finally:
        os.close(fd)  # also releases the test lock


def owned_elsewhere(run_dir: Path) -> Optional[dict]:
    """The live process other than this one that owns run_dir, if any."""
    return None if Path(run_dir).absolute() in _held else live_owner(run_dir)


# The temporary names of the run's own writes, exactly: checkpoint.py's `.NAME.PID.HEX8.tmp`, status.py's
# `.NAME.tmp-PID` (status.json, summary.json), metrics.py's `.metrics.csv.tmp`, plots.py's `.curves.png.tmp.png`.
_RUN_TEMP = re.compile(r"\.(?:status|summary)\.json\.tmp-\d+|\.metrics\.csv\.tmp|\.curves\.png\.tmp\.png")
_CHECKPOINT_TEMP = re.compile(r"\.(?:step-\d+|last)\.pt\.\d+\.[0-9a-f]{8}\.tmp")


def run_temp_files(run_dir: Path) -> list[Path]:
    """Temporary files a killed write of the run left behind; a user's own *.tmp does not match."""
    found = []
    for directory, names in ((Path(run_dir), _RUN_TEMP), (Path(run_dir) / "checkpoints", _CHECKPOINT_TEMP)):
        if directory.is_dir():
            found += [p for p in directory.iterdir() if names.fullmatch(p.name) and p.is_file()]
    return sorted(found)


def check_belongs(run_dir: Path, config: dict, resuming: bool, key: str) -> None:
    """OutputError unless a run of `config` (the job config as Hydra stores it) may start in run_dir:
    a directory holding another run's .hydra/config.yaml is refused, and so is a fresh start over
    this run's checkpoints. trainer.resume is not part of a run's identity."""
    saved = Path(run_dir) / ".hydra" / "config.yaml"
    if not saved.is_file():
        return  # new, or a folder without a run in it: a run's files go beside whatever is there
    try:
        old = yaml.safe_load(saved.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise OutputError(f"{key}={run_dir} holds a run whose {saved} cannot be read ({type(err).__name__}): choose another {key}") from err
    differ = _differences(old, config)
    if differ:
        shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise OutputError(f"{key}={run_dir} holds another run (its config differs: {shown}): a run directory belongs to one run: "
                          f"choose another {key}, or give that run's own overrides to continue it")
    from .checkpoint import checkpoint_files, step_of

    found = checkpoint_files(Path(run_dir) / "checkpoints")
    if found and not resuming:
        step = step_of(found[0])
        raise OutputError(f"{key}={run_dir} holds this run's checkpoints{f' (up to step {step})' if step is not None else ''}: "
                          f"continue it with trainer.resume=auto, or choose another {key} to start over")


def _differences(old: object, new: object, where: str = "") -> list[str]:
    """`key: old -> new` for each leaf that differs (trainer.resume excluded)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            place = f"{where}.{k}" if where else str(k)
            if place != "trainer.resume":
                out += _differences(old.get(k, "<absent>"), new.get(k, "<absent>"), place)
        return out
    return [] if old == new else [f"{where or 'config'}: {str(old)[:40]} -> {str(new)[:40]}"]


def take_over(run_dir: Path) -> list[str]:
    """For a directory this process now owns: clean up after a run that was killed. Returns what was done, one line each."""
    run_dir = Path(run_dir)
    said = []
    stale = run_temp_files(run_dir)
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        said.append(f"removed {len(stale)} temporary file(s) left by an interrupted write: {', '.join(p.name for p in stale)}")
    from .checkpoint import remove_unnamed_shards

    shards = remove_unnamed_shards(run_dir / "checkpoints")
    if shards:
        said.append(f"removed {len(shards)} shard file(s) of an interrupted checkpoint write (no manifest names them)")
    if _mark_if_dead(run_dir, owned_here=True):
        said.append(f"{run_dir}: status.json said running but its process is gone: marked killed")
    return said


KILLED_REASON = "its process ended without a final status (killed: kill -9, out of memory, or the machine went down)"
_SKIP = {"checkpoints", "hf", "adapter", ".hydra", "tensorboard", "mlruns", "wandb"}  # a run's own folders: no runs inside
_scanned: set[Path] = set()


def mark_killed(output_root: Path) -> list[str]:
    """Mark `killed` every run under output_root whose status.json says running but whose process is gone
    (once per process and root). Returns one line per run marked."""
    root = Path(output_root).absolute()
    if root in _scanned or not root.is_dir():
        return []
    _scanned.add(root)
    said = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP]
        if "status.json" in files and _mark_if_dead(Path(here), owned_here=False):
            said.append(f"{here}: status.json said running but its process is gone: marked killed")
    return said


def _mark_if_dead(run_dir: Path, owned_here: bool) -> bool:
    status = read_status(run_dir)
    if status.get("state") != "running" or (not owned_here and live_owner(run_dir) is not None):
        return False
    if not owned_here and not (Path(run_dir) / OWNER).is_file():
        return False  # never locked (a run of an older rptrain): its liveness cannot be told
    details = {k: v for k, v in status.items() if k not in ("state", "time")}
    try:
        write_status(run_dir, "killed", reason=KILLED_REASON, **details)
    except OSError:
        return False  # not ours to write (another user's run, a read-only copy): leave it
    return True


def _read(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / OWNER).read_text())
    except (OSError, ValueError):
        return {}


def _pid_alive(info: dict) -> bool:
    """Where locks are not available: a process of that pid on this host is running (on another host: assume so)."""
    if not info:
        return False
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, KeyError):
        return True
    return True


def _busy(run_dir: Path) -> OutputError:
    who = _read(run_dir)
    since = f", started {who['started']}" if who.get("started") else ""
    return OutputError(
        f"{run_dir} belongs to a run that is still going (pid {who.get('pid', '?')} on {who.get('host', '?')}{since}): "
        f"wait for it or stop it, or choose another hydra.run.dir"
    )

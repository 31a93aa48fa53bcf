"""What the run shows on the terminal: the config tree, a live progress bar, the epoch lines.

Everything goes through one rich Console. Off a terminal (SLURM logs, pipes, tests) the live
bar is replaced by one plain line per log step, so log files stay readable. The terminal is a
view, not the run: when it goes away (`rptrain ... | head`, a closed SSH session) the console
goes quiet and the run, its log file and its metrics go on.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Optional

from omegaconf import DictConfig
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.tree import Tree

from .shown_config import shown_config

log = logging.getLogger("rptrain")

_NAMES = {"acc": "Acc", "ppl": "PPL"}


class RunConsole(Console):
    """rich's Console, except that a closed stdout silences it instead of ending the process (rich's default)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout()

    def _check_buffer(self) -> None:
        try:
            super()._check_buffer()
        except OSError:  # EIO and friends: the terminal is gone
            self.quiet = True
            del self._buffer[:]
            silence_stdout()


def silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so that later writes (and the interpreter's last flush) succeed unseen."""
    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else 1
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (OSError, ValueError):
        pass


def make_console() -> Console:
    console = RunConsole(highlight=False, soft_wrap=True)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 160  # log files: rich's 80-column default would truncate the sweep table
    return console


def config_tree(cfg: DictConfig, label: str = "config") -> Tree:
    """The resolved config as a tree, one branch per group (values from the environment as written: shown_config.py)."""
    tree = Tree(f"[bold]{label}[/bold]")

    def add(node: Tree, value: Any) -> None:
        for key, child in value.items():
            if isinstance(child, dict):
                add(node.add(f"[bold cyan]{key}[/bold cyan]"), child)
            else:
                node.add(f"{key}: [green]{child!r}[/green]" if isinstance(child, str) else f"{key}: {child}")

    add(tree, shown_config(cfg))
    return tree


def say(console: Console, text: str) -> None:
    """A plain line on the terminal (no markup) and in the run's log file."""
    console.print(text, markup=False, highlight=False)
    log.info(text)


def loud(console: Console, text: str) -> None:
    """A line that must not be missed (bold on a terminal), and in the run's log file."""
    console.print(text, markup=False, highlight=False, style="bold yellow")
    log.warning(text)


def _f(value: object) -> str:
    """A metric as the lines show it; null (a NaN/inf in metrics.jsonl, e.g. a GradScaler overflow) as nan."""
    return "nan" if value is None else f"{value:.4f}"


def epoch_line(epoch: int, epochs: int, rec: dict, metric: str) -> str:
    """The tutorial's line: `Epoch 01/20 | Train Loss: 4.3328 | Train Acc: 0.0413 | Test Loss: ... | Test Acc: ...`."""
    name = _NAMES[metric]
    parts = [f"Epoch {epoch:02d}/{epochs}", f"Train Loss: {_f(rec['train_loss'])}", f"Train {name}: {_f(rec[f'train_{metric}'])}"]
    if rec.get("test_loss") is not None:
        parts += [f"Test Loss: {_f(rec['test_loss'])}", f"Test {name}: {_f(rec[f'test_{metric}'])}"]
    return " | ".join(parts)


def epoch_rate_line(epoch: int, epochs: int, rec: dict) -> str:
    """The whole epoch's throughput: its training samples over its wall time, evaluation included."""
    return (f"Epoch {epoch:02d}/{epochs} took {rec['epoch_wall_time']:.2f} s with its evaluation: "
            f"{rec['epoch_samples_per_s']:,.0f} samples/s")


def step_line(rec: dict, total: int, metric: str, unit: str) -> str:
    rate = rec.get(f"{unit}_per_s") or 0.0
    return (
        f"step {rec['step']}/{total} | epoch {rec['epoch']} | loss {_f(rec['loss'])} | {metric} {_f(rec[metric])} | "
        f"lr {rec['lr']:.3g} | scale {rec['loss_scale']:g} | {rate:,.0f} {unit.replace('_', ' ')}/s | "
        f"data {1e3 * rec['data_time']:.1f} ms, step {1e3 * rec['step_time']:.1f} ms"
    )


class ProgressBar:
    """A per-epoch bar with loss and throughput. Without it (off a terminal) the same stats go out as
    a plain line after the first step and then every `heartbeat_s` seconds in which no log line went
    out, so a SLURM log shows the run is alive long before the first log_interval step."""

    def __init__(self, console: Console, enabled: Optional[bool], heartbeat_s: float = 30.0) -> None:
        self.enabled = console.is_terminal if enabled is None else enabled
        self.console, self.heartbeat_s = console, heartbeat_s
        self._plain: Optional[list] = None  # [description, done, total] of the epoch, for the plain lines
        self._last_line: Optional[float] = None
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[stats]}"),
            console=console, transient=True, disable=not self.enabled,
            refresh_per_second=4,  # rendering holds the GIL the step's issuing thread needs
        )
        self._task: Optional[int] = None

    def __enter__(self) -> "ProgressBar":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)

    def start_epoch(self, description: str, total: int, done: int) -> None:
        self._plain = [description, done, total]
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(description, total=total, completed=done, stats="")

    def advance(self, stats: Optional[Callable[[], str]] = None, logged: bool = False) -> None:
        """One step done; `logged`: a log line for it goes out anyway. Off a terminal, stats() (a read
        of the step's numbers, so a wait for the GPU) is called only for a heartbeat line."""
        if self.enabled and self._task is not None:
            self._progress.update(self._task, advance=1)
        if self.enabled or self._plain is None:
            return
        self._plain[1] += 1
        now = time.monotonic()
        due = self._last_line is None or now - self._last_line >= self.heartbeat_s
        if due and not logged:
            description, done, total = self._plain
            say(self.console, f"{description}: {done}/{total}" + (f" | {stats()}" if stats else ""))
        if due or logged:
            self._last_line = now

    def show(self, stats: str) -> None:
        """Loss and throughput next to the bar: updated at log steps, the only time they are read."""
        if self.enabled and self._task is not None:
            self._progress.update(self._task, stats=stats)

"""Ctrl-C while the program is still starting (importing torch and Hydra, composing the config): one
line and exit 130, not a KeyboardInterrupt traceback through the import machinery.

Only for a script run in the main thread: an interactive session keeps its KeyboardInterrupt, and
whoever imports rptrain gets their own SIGINT handler back once the import is done.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable


def _exit_quietly(signum: int, frame: object) -> None:
    try:
        os.write(2, b"\nrptrain: interrupted (SIGINT) outside a training step: stopped, nothing to save\n")
    finally:
        os._exit(128 + signum)  # not an exception: import machinery and except-clauses would see it first


def quiet_interrupts() -> Callable[[], None]:
    """Install the quiet handler; returns what puts the previous one back (a no-op where none was installed)."""
    interactive = hasattr(sys, "ps1") or sys.flags.interactive
    if interactive or threading.current_thread() is not threading.main_thread():
        return lambda: None
    try:
        previous = signal.signal(signal.SIGINT, _exit_quietly)
    except (ValueError, OSError):  # an embedding without signals
        return lambda: None
    if previous is _exit_quietly or previous is None:  # nested (the package, then the CLI module), or set outside Python
        previous = signal.default_int_handler

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is _exit_quietly:
            signal.signal(signal.SIGINT, previous)

    return restore

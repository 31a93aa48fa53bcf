"""An entry point called in this process as its console script would run it: exit code, stdout, stderr,
and the exception that escaped it (a traceback in a real process)."""
from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Callable

from . import outcome as o


def call(main: Callable[[list[str]], None], args: list[str], cwd: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_argv = os.getcwd(), list(sys.argv)
    os.chdir(cwd)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                main(list(args))
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            except BaseException:  # noqa: BLE001 - what the interpreter would print as a traceback
                traceback.print_exc(file=err)
                code = 1
    finally:
        os.chdir(old_cwd)
        sys.argv[:] = old_argv
    return code, out.getvalue(), err.getvalue()


def judged(kind: str, case: str, code: int, err: str, markers: Path, must_refuse: bool, detail: dict) -> o.Trial:
    """A payload's marker means code ran; a bad input must be refused (one line, non-zero) unless it is harmless."""
    detail["exit"] = code
    if any(markers.iterdir()):
        for m in markers.iterdir():
            m.unlink()
        return o.Trial(kind, case, o.CODE_EXECUTED, detail)
    result = o.classify_exit(code, err)
    if result in o.FAILURES:
        detail["stderr"] = err[-800:]
        return o.Trial(kind, case, result, detail)
    if result == "completed" and must_refuse:
        return o.Trial(kind, case, o.ACCEPTED, detail)
    if result == "refused":
        detail["line"] = err.strip().splitlines()[-1][:240]
    return o.Trial(kind, case, result, detail)

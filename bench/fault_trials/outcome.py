"""How a trial ends: one outcome name, and whether it is a failure of the issue's goal.

The goal (issue 31): 0 code executed, 0 runs mixed or lost, 0 hangs past 10 s after a signal,
0 tracebacks. Every other outcome is an acceptable end (the run completed, stopped on a signal,
or refused bad input with one line and a non-zero exit)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Failures, each named after the goal it breaks.
CODE_EXECUTED = "code_executed"  # a payload's marker file appeared
LOST = "run_mixed_or_lost"  # a corrupt checkpoint, a resume that is not bit-identical, work silently thrown away
HANG = "hang"  # no exit within the limit (10 s after a signal)
TRACEBACK = "traceback"  # a Python traceback instead of one line
BAD_END = "bad_end"  # wrong exit code, several lines, or a status.json that does not say how the run ended
ACCEPTED = "corrupt_accepted"  # a damaged file was used as if it were whole
FAILURES = (CODE_EXECUTED, LOST, HANG, TRACEBACK, BAD_END, ACCEPTED)


@dataclass
class Trial:
    kind: str
    case: str
    outcome: str
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES

    def record(self) -> dict[str, Any]:
        return asdict(self)


def classify_exit(code: int, stderr: str, *, ok_codes: tuple[int, ...] = (0,)) -> str:
    """A finished process: ``completed`` (exit 0), ``refused`` (one line, non-zero), else the failure."""
    if "Traceback (most recent call last)" in stderr:
        return TRACEBACK
    if code in ok_codes:
        return "completed" if code == 0 else "stopped"
    lines = [line for line in stderr.splitlines() if line.strip() and not _is_warning(line)]
    return "refused" if code != 0 and len(lines) == 1 else BAD_END


def _is_warning(line: str) -> bool:
    """Warnings (a deprecation in a dependency, ours about a setting) print beside the one error line."""
    return "Warning:" in line or line.startswith("  ")

"""rptrain.log's handler: a write that fails (a full disk, a lost mount) is dropped quietly.

logging's own FileHandler prints "--- Logging error ---" and a traceback on stderr for each failed
record, beside the run's one-line error about the same full disk (issue 31's campaign). The log is
a copy of what the console and metrics already say; the run's own writes report the disk.
"""
from __future__ import annotations

import logging


class LogFile(logging.FileHandler):
    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            pass

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the buffered rest had no room either
            pass

"""rptrain.log on a full disk: the failed writes are dropped quietly, not one "--- Logging error ---" traceback
each beside the run's one-line error (issue 31's campaign: a 19 KiB tmpfs)."""
from __future__ import annotations

import logging
from pathlib import Path

from rptrain.cli.log_file import LogFile

ROOT = Path(__file__).resolve().parents[1]


def test_a_full_disk_under_the_log_file_prints_nothing(capfd):
    handler = LogFile("/dev/full")  # every write fails with ENOSPC
    log = logging.getLogger("rptrain-test-full-disk")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.error("a record the disk has no room for")
    finally:
        log.removeHandler(handler)
        handler.close()
    assert capfd.readouterr().err == ""


def test_the_run_log_uses_it():
    assert "class: rptrain.cli.log_file.LogFile" in (ROOT / "conf" / "hydra" / "job_logging" / "rptrain.yaml").read_text()

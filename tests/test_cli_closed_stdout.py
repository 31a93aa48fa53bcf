"""`rptrain ... | head -n 5`: the reader goes away early; the run does not stop for it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_cli_helpers import TEST_ENV, TINY, read_jsonl, train_losses


@pytest.mark.slow
def test_a_closed_stdout_does_not_stop_the_run(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rptrain.cli.main", *TINY, "data.num_train=256", "trainer.max_steps=12",
                             f"hydra.run.dir={run}"], cwd=tmp_path, env=TEST_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(5):  # head -n 5
            proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=180)
    finally:
        proc.kill()
    assert code == 0 and "Traceback" not in err and "Exception ignored" not in err, (code, err)
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    assert sorted(train_losses(read_jsonl(run / "metrics.jsonl"))) == list(range(1, 13))  # the file logs went on
    assert "done: 12 steps" in (run / "rptrain.log").read_text()

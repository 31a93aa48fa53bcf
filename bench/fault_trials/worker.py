"""The in-process kinds (files and the engine's API), run in a process of their own so that a hang or a
crash costs only that kind: ``python -m fault_trials.worker KIND COUNT SEED WORK``. Prints a ``begin``
line before each trial and the trial's record after it, one JSON object a line."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def main(kind: str, count: int, seed: int, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    markers = work / "markers"  # a payload that runs writes here
    markers.mkdir(exist_ok=True)
    rng = random.Random(seed)
    if kind == "checkpoint":
        from .checkpoints import checkpoint_trial, make_base

        base = make_base(work)
        trial = lambda i: checkpoint_trial(i, work, base, markers, rng)  # noqa: E731
    elif kind == "hf_folder":
        from .inputs import hf_trial, make_hf_folder

        base = make_hf_folder(work)
        trial = lambda i: hf_trial(i, work, base, markers, rng)  # noqa: E731
    elif kind == "data_file":
        from .inputs import data_trial

        trial = lambda i: data_trial(i, work, markers, rng)  # noqa: E731
    elif kind == "template":
        from .inputs import template_trial

        trial = lambda i: template_trial(i, work, markers, rng)  # noqa: E731
    else:
        from .engine_api import engine_trial

        trial = lambda i: engine_trial(i, rng)  # noqa: E731
    for i in range(count):
        print(json.dumps({"begin": i}), flush=True)
        print(json.dumps(trial(i).record(), default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))

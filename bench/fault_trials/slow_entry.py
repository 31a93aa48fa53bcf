"""``rptrain`` with one part made to wait 600 s (data preparation or evaluation), a marker file written
when it begins: a signal sent then lands outside any training step.
Usage: python slow_entry.py data|eval MARKER RPTRAIN_ARGS..."""
import pathlib
import sys
import time

where, marker = sys.argv[1], pathlib.Path(sys.argv[2])


def slow(real):
    def wrapper(*args, **kwargs):
        marker.write_text("begun")
        time.sleep(600)
        return real(*args, **kwargs)
    return wrapper


if where == "data":
    from rptrain.train import setup
    setup.build_data = slow(setup.build_data)
else:
    from rptrain.train import loop
    loop.Trainer._evaluate = slow(loop.Trainer._evaluate)
from rptrain.cli.main import command  # noqa: E402

command(sys.argv[3:])

"""A torchrun target for tests/test_cli_dist.py: the rptrain CLI, with a fault injected from
outside the training loop on the last rank, just before its step S (LanguageTask.train_step is
patched, so rank 0 is already inside that step's gradient averaging when the fault strikes).

Usage: torchrun ... tests/faulty_rank.py die|hang S [rptrain overrides...]
  die   the process ends at once, without cleanup or goodbye (a crashed node)
  hang  the process blocks until it is signalled (torchrun's SIGTERM after the others failed)
"""
import os
import sys
import time

from rptrain.cli.main import main
from rptrain.train import signals, tasks

mode, at, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    real_step, real_set, calls, signalled = tasks.LanguageTask.train_step, signals.StopRequest.set, [0], []

    def record_signal(self, signum):
        signalled.append(signum)
        real_set(self, signum)

    def train_step(self, *a, **kw):
        calls[0] += 1
        if calls[0] == at and mode == "die":
            os._exit(3)
        while calls[0] == at and mode == "hang" and not signalled:
            time.sleep(0.05)
        return real_step(self, *a, **kw)

    signals.StopRequest.set = record_signal
    tasks.LanguageTask.train_step = train_step

main(args)

"""Errors the user can fix. The CLI prints their message as one line and exits with code 2.

Every message names the config key or file at fault and says how to fix it.
"""
from __future__ import annotations

from rptrain.data import DataError
from rptrain.engine.fit import DoesNotFit


class ConfigError(ValueError):
    """A config value that composes but cannot work (batch smaller than num_microbatch, ...)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or written for another model or data set."""


class OutputError(ValueError):
    """The run directory cannot be written (disk full, permissions) or belongs to another live run."""


class NonFiniteLoss(ValueError):
    """A NaN/inf training loss without a GradScaler, with trainer.on_nonfinite=stop."""


class OutOfGpuMemory(RuntimeError):
    """The GPU ran out of memory during the run (out_of_memory.py says what to lower)."""


# DataError comes from rptrain.data (missing dataset, bad text corpus, ...), DoesNotFit from the engine
# (the training state needs more memory than engine.max_host_memory / max_gpu_memory allow).
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, CheckpointError, DataError, OutputError, NonFiniteLoss, DoesNotFit,
                                                 OutOfGpuMemory)


def one_line(text: str) -> str:
    """Collapse whitespace so a message never spans lines."""
    return " ".join(str(text).split())

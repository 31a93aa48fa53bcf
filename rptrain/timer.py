"""The original library's ``roundpipe.timer`` module under rptrain's name (engine/timer.py)."""
from .engine.timer import ModelTimer, report

__all__ = ["ModelTimer", "report"]

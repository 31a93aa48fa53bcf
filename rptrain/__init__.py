"""rptrain: dispatch-pipeline training for models whose training state does not fit on the GPU.

Importing it starts no threads and touches no GPU.
"""
from ._startup import quiet_interrupts

_restore_interrupts = quiet_interrupts()  # Ctrl-C while torch imports: one line, not a traceback (_startup.py)
from . import optim, timer
from .engine import (ExecutePlan, GradScaler, ModelExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, Tuning, doing_recompute,
                     get_recompute_data, save_for_recompute, wrap_model, wrap_model_to_roundpipe)

__all__ = ["RoundPipe", "RoundPipeRunConfig", "OptimizerCtx", "GradScaler", "Tuning", "ExecutePlan", "ModelExecutePlan", "optim", "timer",
           "wrap_model", "wrap_model_to_roundpipe", "save_for_recompute", "doing_recompute", "get_recompute_data"]
__version__ = "0.1.0"
_restore_interrupts()

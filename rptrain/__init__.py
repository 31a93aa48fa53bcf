"""rptrain: dispatch-pipeline training for models whose training state does not fit on the GPU.

Importing it starts no threads and touches no GPU.
"""
from .engine import ExecutePlan, GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig

__all__ = ["RoundPipe", "RoundPipeRunConfig", "OptimizerCtx", "GradScaler", "ExecutePlan"]
__version__ = "0.1.0"

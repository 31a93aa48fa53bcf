"""rptrain: dispatch-pipeline training for models whose training state does not fit on the GPU.

Importing it starts no threads and touches no GPU.
"""
from .engine import ExecutePlan, GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, wrap_model, wrap_model_to_roundpipe

__all__ = ["RoundPipe", "RoundPipeRunConfig", "OptimizerCtx", "GradScaler", "ExecutePlan", "wrap_model", "wrap_model_to_roundpipe"]
__version__ = "0.1.0"

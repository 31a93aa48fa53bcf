"""The RoundPipe-style dispatch pipeline engine."""
from .config import RoundPipeRunConfig
from .plan import ExecutePlan, LayerCost, plan_stages
from .roundpipe import OptimizerCtx, RoundPipe
from .scaler import GradScaler
from .wrap import WrappedModel, wrap_model, wrap_model_to_roundpipe

__all__ = ["RoundPipe", "RoundPipeRunConfig", "OptimizerCtx", "GradScaler", "ExecutePlan", "LayerCost", "plan_stages",
           "WrappedModel", "wrap_model", "wrap_model_to_roundpipe"]

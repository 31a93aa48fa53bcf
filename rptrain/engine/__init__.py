"""The RoundPipe-style dispatch pipeline engine."""
from .config import RoundPipeRunConfig
from .fit import DoesNotFit
from .model_plan import ModelExecutePlan
from .plan import ExecutePlan, LayerCost, plan_stages
from .prefit import check_model_fits
from .optimizer_ctx import OptimizerCtx
from .roundpipe import RoundPipe
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .scaler import GradScaler
from .tuning import Tuning
from .wrap import WrappedModel, wrap_model, wrap_model_to_roundpipe

__all__ = ["RoundPipe", "RoundPipeRunConfig", "OptimizerCtx", "GradScaler", "Tuning", "DoesNotFit", "check_model_fits", "ExecutePlan", "ModelExecutePlan", "LayerCost",
           "plan_stages",
           "WrappedModel", "wrap_model", "wrap_model_to_roundpipe",
           "save_for_recompute", "doing_recompute", "get_recompute_data"]

"""Model zoo: every model is an `nn.Sequential` of self-contained layers.

The pipeline engine uploads runs of consecutive layers to the GPU, so each
element must take the previous element's output and hold only weights.
Importing a model module registers its builders; keep these imports cheap.
"""

from rptrain.models.registry import build_model, list_models, register_model
from rptrain.models import hf_model, llama, resnet  # noqa: E402,F401  (imported to register the builders)
from rptrain.models.llama import LLAMA_PRESETS, build_llama, flops_per_token, llama_config, parameter_count
from rptrain.models.hf_config import HFModelError
from rptrain.models.llama_config import LlamaConfig
from rptrain.models.llama_loss import IGNORE_INDEX, count_tokens
from rptrain.models.llama_weights import load_weights

__all__ = [
    "build_model", "list_models", "register_model",
    "LlamaConfig", "LLAMA_PRESETS", "llama_config", "build_llama", "parameter_count", "flops_per_token",
    "IGNORE_INDEX", "count_tokens", "load_weights", "HFModelError",
]

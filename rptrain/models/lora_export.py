"""LoRA adapters alone, in PEFT's format: a folder `peft.PeftModel.from_pretrained` loads.

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules, ...
    adapter_model.safetensors    base_model.model.<Hugging Face name>.lora_A.weight / .lora_B.weight

The Hugging Face names come from hf_names.py, so this works for every decoder that follows it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from rptrain.models.hf_names import hf_name
from rptrain.models.lora import lora_config

PEFT_PREFIX = "base_model.model."


def adapter_state(model: nn.Sequential, state: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's names. ``state``: the weights to take (e.g. an engine's
    fp32 master ``state_dict()``); default the model's own."""
    state = model.state_dict() if state is None else state
    n_layers = len(model) - 2
    return {PEFT_PREFIX + hf_name(_peft_name(k, state), n_layers): t.detach().contiguous()
            for k, t in state.items() if ".lora_A." in k or ".lora_B." in k}


def _peft_name(key: str, state: dict) -> str:
    """Our expert adapter names as PEFT's ParamWrapper nests them: with both expert matrices targeted,
    gate_up_proj's wrapper is the inner one (`experts.base_layer.lora_A`), down_proj's the outer
    (`experts.lora_A`); one targeted matrix is `experts.lora_A` (peft 0.21)."""
    for group in (".adapters.", ".adapters_in_out."):
        if group in key:
            prefix, _, rest = key.partition(group)
            name, _, leaf = rest.partition(".")
            both = all(f"{prefix}{group}{p}.lora_A.weight" in state for p in ("gate_up_proj", "down_proj"))
            return f"{prefix}.base_layer.{leaf}" if both and name == "gate_up_proj" else f"{prefix}.{leaf}"
    return key


def save_adapter(model: nn.Sequential, directory: str | Path, state: Optional[dict[str, torch.Tensor]] = None,
                 base_model: Optional[str] = None) -> Path:
    """Write ``model``'s adapters to ``directory``; ``base_model`` goes into the config for PEFT to find."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lora = lora_config(model)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
        "target_modules": lora["target_modules"] or None, "target_parameters": lora["target_parameters"] or None, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(adapter_state(model, state), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory

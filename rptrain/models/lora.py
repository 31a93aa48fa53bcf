"""LoRA: low-rank adapters on a decoder's projections, the base weights frozen.

`LoraLinear` wraps a frozen `nn.Linear` as PEFT does (same names, init and arithmetic, so adapters
move between the two as they are):

    y = base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / rank

`lora_A` starts as nn.Linear's own init (kaiming_uniform_, a=sqrt(5)) and `lora_B` at zero, so step
0 is the base model. The engine stores the frozen base once, in its own dtype (engine/host.py).

Targets are short names mapped onto the projection modules' names (hf_names.py's convention).
Phi-3's fused `qkv_proj` / `gate_up_proj` get one adapter each over the whole fused output, as PEFT
targets them (one module): they are adapted when every part they fuse is a target (q, k, v and
gate, up), and naming only some of the parts is an error, since one adapter cannot cover part of a
matrix.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

# Short name -> the projection modules it stands for, in transformers' names.
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
FUSED = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
DEFAULT_TARGETS = tuple(TARGETS)


class LoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        kw = dict(bias=False, dtype=base_layer.weight.dtype, device=base_layer.weight.device)
        self.base_layer = base_layer.requires_grad_(False)
        self.lora_A = nn.Linear(base_layer.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, base_layer.out_features, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def merged(self) -> nn.Linear:
        """The base layer with the adapter folded in."""
        with torch.no_grad():
            self.base_layer.weight.copy_(fold(self.base_layer.weight, self.lora_A.weight, self.lora_B.weight, self.scaling))
        return self.base_layer


def fold(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """weight + scaling * B @ A, computed in fp32 and returned in the weight's dtype."""
    return (weight.float() + (lora_b.float() @ lora_a.float()) * scaling).to(weight.dtype)


def target_modules(targets: Sequence[str]) -> set[str]:
    """Short names -> the module names they adapt (fused modules included when wholly targeted)."""
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"model.lora.targets={list(targets)}: allowed {', '.join(TARGETS)} (at least one)")
    names = {TARGETS[t] for t in targets}
    for fused, parts in FUSED.items():
        if all(p in targets for p in parts):
            names.add(fused)
    return names


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets: Sequence[str] = DEFAULT_TARGETS) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap the targeted `nn.Linear`s in `LoraLinear` (in place)."""
    if rank < 1:
        raise ValueError(f"model.lora.rank={rank}: LoRA needs a rank of at least 1 (0 means full fine-tuning)")
    names = target_modules(targets)
    model.requires_grad_(False)
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in names and isinstance(child, nn.Linear):
                setattr(parent, name, LoraLinear(child, rank, alpha, dropout))
                found += 1
            elif name in FUSED and isinstance(child, nn.Linear) and any(TARGETS[p] in names for p in FUSED[name]):
                wanted = [p for p in FUSED[name] if TARGETS[p] in names]
                raise ValueError(f"model.lora.targets: {name} fuses {'/'.join(FUSED[name])}; target all of them or none, not only {'/'.join(wanted)}")
    if not found:
        raise ValueError(f"model.lora.targets={list(targets)}: the model has no nn.Linear named {', '.join(sorted(names))}")
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every `LoraLinear` by its base layer with the adapter folded in (in place)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoraLinear):
                setattr(parent, name, child.merged())
    return model


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict with every adapter folded into its base weight, under the plain
    model's names ('1.self_attn.q_proj.weight'): what a merged export writes."""
    out = {}
    for key, t in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            prefix, _, leaf = key.partition(".base_layer.")
            if leaf == "weight":
                t = fold(t, state[f"{prefix}.lora_A.weight"], state[f"{prefix}.lora_B.weight"], scaling)
            key = f"{prefix}.{leaf}"
        out[key] = t
    return out


def lora_config(model: nn.Module) -> dict:
    """rank, alpha, dropout and the adapted module names of a model `apply_lora` changed."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    first = layers[0]
    dropout = first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0
    modules = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, LoraLinear)})
    return {"rank": first.rank, "alpha": first.alpha, "dropout": dropout, "target_modules": modules}

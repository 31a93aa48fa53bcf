"""LoRA: low-rank adapters on a decoder's projections, the base weights frozen.

`LoraLinear` wraps a frozen `nn.Linear` as PEFT does (same names, init and arithmetic, so adapters
move between the two as they are):

    y = base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / rank

`lora_A` starts as nn.Linear's own init (kaiming_uniform_, a=sqrt(5)) and `lora_B` at zero, so step
0 is the base model. The engine stores the frozen base once, in its own dtype (engine/host.py).

Targets are short names mapped onto the projection modules' names (hf_names.py's convention).
MoE experts (`experts_gate_up`, `experts_down`) get PEFT's ParamWrapper adapters: one rank-r pair per
expert, stored as PEFT stores them (lora_A (r*E, in), lora_B (out, r*E)), applied to the tokens routed
to each expert by grouped GEMMs (rptrain.models.experts). The router stays frozen unless train_router.

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
# Short name -> the expert matrix it adapts (PEFT: target_parameters=["mlp.experts.gate_up_proj", ...]).
EXPERT_TARGETS = {"experts_gate_up": "gate_up_proj", "experts_down": "down_proj"}
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


class ExpertFactors(nn.Module):
    """One expert matrix's adapters, as PEFT's ParamWrapper holds them: lora_A (r*E, in), lora_B (out, r*E),
    expert e's pair being rows e*r:(e+1)*r of A and columns e, E+e, 2E+e, ... of B."""

    def __init__(self, n_experts: int, n_in: int, n_out: int, rank: int, device, dtype):
        super().__init__()
        self.n_experts, self.rank = n_experts, rank
        self.lora_A = nn.Linear(n_in, rank * n_experts, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank * n_experts, n_out, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def per_expert(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a (E, in, r), b (E, r, out)): x @ a[e] @ b[e] is expert e's update of x."""
        E, r = self.n_experts, self.rank
        a = self.lora_A.weight.view(E, r, -1).transpose(1, 2)
        b = self.lora_B.weight.view(-1, r, E).permute(2, 1, 0).contiguous()
        return a, b


def expert_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, interleaved: bool) -> torch.Tensor:
    """The update of a stored expert matrix, in its layout: (E, out, in), or (E, in, out) when interleaved (GPT-OSS)."""
    delta = torch.bmm(a.float(), b.float()) * scaling  # (E, in, out)
    return delta if interleaved else delta.transpose(1, 2)


class LoraExperts(nn.Module):
    """Frozen experts (`base_layer`) plus adapters on some of their matrices: `adapters.<name>` for experts
    stored (E, out, in), `adapters_in_out.<name>` for GPT-OSS's (E, in, out), so a state dict says its layout."""

    def __init__(self, base: nn.Module, names: Sequence[str], rank: int, alpha: float):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        adapters = {}
        for name in names:
            weight = getattr(base, name)
            E, first, second = weight.shape
            n_in, n_out = (first, second) if base.interleaved else (second, first)
            adapters[name] = ExpertFactors(E, n_in, n_out, rank, weight.device, weight.dtype)
        self.group = "adapters_in_out" if base.interleaved else "adapters"
        self.add_module(self.group, nn.ModuleDict(adapters))

    def factors(self) -> nn.ModuleDict:
        return self._modules[self.group]

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        lora = {name: (*f.per_expert(), self.scaling) for name, f in self.factors().items()}
        return self.base_layer(x, experts, weights, lora)

    def merged(self) -> nn.Module:
        with torch.no_grad():
            for name, f in self.factors().items():
                weight = getattr(self.base_layer, name)
                weight.copy_((weight.float() + expert_delta(*f.per_expert(), self.scaling, self.base_layer.interleaved)).to(weight.dtype))
        return self.base_layer


def fold(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """weight + scaling * B @ A, computed in fp32 and returned in the weight's dtype."""
    return (weight.float() + (lora_b.float() @ lora_a.float()) * scaling).to(weight.dtype)


def target_modules(targets: Sequence[str]) -> set[str]:
    """Short names -> the module names they adapt (fused modules included when wholly targeted)."""
    unknown = [t for t in targets if t not in TARGETS and t not in EXPERT_TARGETS]
    if unknown or not targets:
        raise ValueError(f"model.lora.targets={list(targets)}: allowed {', '.join([*TARGETS, *EXPERT_TARGETS])} (at least one)")
    names = {TARGETS[t] for t in targets if t in TARGETS}
    for fused, parts in FUSED.items():
        if all(p in targets for p in parts):
            names.add(fused)
    return names


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets: Sequence[str] = DEFAULT_TARGETS,
               train_router: bool = False) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap the targeted `nn.Linear`s in `LoraLinear` and targeted
    experts in `LoraExperts` (in place); train_router: MoE routers are trained in full."""
    from rptrain.models.experts import Experts
    from rptrain.models.router import TopKRouter

    if rank < 1:
        raise ValueError(f"model.lora.rank={rank}: LoRA needs a rank of at least 1 (0 means full fine-tuning)")
    names = target_modules(targets)
    expert_names = [EXPERT_TARGETS[t] for t in EXPERT_TARGETS if t in targets]
    if expert_names and dropout > 0:
        raise ValueError(f"model.lora.dropout={dropout}: adapters on experts take no dropout (as PEFT's): set it to 0")
    model.requires_grad_(False)
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, TopKRouter) and train_router:
                child.requires_grad_(True)
            elif isinstance(child, Experts) and expert_names:
                setattr(parent, name, LoraExperts(child, expert_names, rank, alpha))
                found += 1
            elif name in names and isinstance(child, nn.Linear):
                setattr(parent, name, LoraLinear(child, rank, alpha, dropout))
                found += 1
            elif name in FUSED and isinstance(child, nn.Linear) and any(TARGETS[p] in names for p in FUSED[name]):
                wanted = [p for p in FUSED[name] if TARGETS[p] in names]
                raise ValueError(f"model.lora.targets: {name} fuses {'/'.join(FUSED[name])}; target all of them or none, not only {'/'.join(wanted)}")
    if not found:
        raise ValueError(f"model.lora.targets={list(targets)}: the model has no nn.Linear named {', '.join(sorted(names))} "
                         f"{'and no experts' if expert_names else ''}")
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every `LoraLinear` by its base layer with the adapter folded in (in place)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (LoraLinear, LoraExperts)):
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
            for group in ("adapters", "adapters_in_out"):  # an adapted expert matrix, in the (E, out, in) or (E, in, out) layout
                if f"{prefix}.{group}.{leaf}.lora_A.weight" in state:
                    a, b = state[f"{prefix}.{group}.{leaf}.lora_A.weight"], state[f"{prefix}.{group}.{leaf}.lora_B.weight"]
                    E, r = t.shape[0], a.shape[0] // t.shape[0]
                    a, b = a.view(E, r, -1).transpose(1, 2), b.view(-1, r, E).permute(2, 1, 0)
                    t = (t.float() + expert_delta(a, b, scaling, group == "adapters_in_out")).to(t.dtype)
            key = f"{prefix}.{leaf}"
        out[key] = t
    return out


def lora_config(model: nn.Module) -> dict:
    """rank, alpha, dropout and the adapted module names of a model `apply_lora` changed."""
    layers = [m for m in model.modules() if isinstance(m, (LoraLinear, LoraExperts))]
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    first = layers[0]
    dropout = first.dropout.p if isinstance(getattr(first, "dropout", None), nn.Dropout) else 0.0
    modules = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, LoraLinear)})
    parameters = sorted({f"{name.rpartition('.')[0].rpartition('.')[2]}.experts.{p}" for name, m in model.named_modules()
                         if isinstance(m, LoraExperts) for p in m.factors()})
    return {"rank": first.rank, "alpha": first.alpha, "dropout": dropout, "target_modules": modules, "target_parameters": parameters}

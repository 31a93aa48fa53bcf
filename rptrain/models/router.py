"""The MoE router: which top_k experts each token goes to, and with what weights; in float32.

Routing is a discrete choice made in the forward pass. The engine runs a backward stage's layers
forward again (recompute), and a different choice there (another reduction order on the GPU, a tie)
would give gradients of a forward that never ran. So the forward keeps the chosen experts
(`save_for_recompute`) and the recompute takes them back; the weights are then recomputed from the
same logits, differentiably.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rptrain.engine.recompute import doing_recompute, get_recompute_data, save_for_recompute
from rptrain.models.decoder_config import MoeConfig


class TopKRouter(nn.Module):
    """weight (n_experts, hidden) [and bias]: transformers' router parameters, under its names."""

    def __init__(self, moe: MoeConfig, hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.top_k, self.routing, self.norm_topk = moe.top_k, moe.routing, moe.norm_topk
        self.weight = nn.Parameter(torch.empty(moe.n_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(moe.n_experts, device=device, dtype=dtype)) if moe.bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, hidden) -> (logits (N, E) float32, weights (N, k) float32, experts (N, k) int64)."""
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)
        if doing_recompute():
            (experts,) = get_recompute_data()
        else:
            with torch.no_grad():
                experts = logits.topk(self.top_k, dim=-1).indices  # softmax keeps the order: the same k either way
            save_for_recompute(experts)
        if self.routing == "topk_softmax":
            return logits, logits.gather(-1, experts).softmax(-1), experts
        weights = logits.softmax(-1).gather(-1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, experts


def balance_stats(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """(2, E) float32: how many of the N x k choices went to each expert (no gradient), and the sum over
    tokens of each expert's router probability: the two sums transformers' load_balancing_loss_func
    accumulates over layers."""
    counts = torch.zeros(logits.size(-1), device=logits.device, dtype=torch.float32)
    counts.index_add_(0, experts.flatten(), torch.ones(experts.numel(), device=logits.device))
    return torch.stack([counts, logits.softmax(-1).sum(0)])


def balance_loss(stats: torch.Tensor, n_tokens: int, n_layers: int) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss as transformers computes it (load_balancing_loss_func,
    no attention mask): E * sum_e (share of choices of expert e) * (mean probability of e), each
    averaged over every token of every routing layer together."""
    rows = n_tokens * n_layers
    return stats.size(-1) * ((stats[0] / rows) * (stats[1] / rows)).sum()

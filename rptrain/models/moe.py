"""A mixture-of-experts MLP block: router + experts, with transformers' module names
(`mlp.gate` or `mlp.router`, `mlp.experts`), and the router statistics the load-balancing loss needs.

The statistics travel with the activations (a (2, n_experts) float32 tensor in the batch tuple, see
decoder.py) so the last layer can make transformers' loss, which couples every routing layer of the
batch, whichever pipeline stage each layer ran on.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from rptrain.models.decoder_config import MoeConfig
from rptrain.models.experts import Experts
from rptrain.models.router import TopKRouter, balance_stats


class SparseMoe(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.router_name = moe.router_name
        self.add_module(moe.router_name, TopKRouter(moe, hidden_size, device, dtype))
        self.experts = Experts(moe, hidden_size, device, dtype)

    def forward(self, x: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D), stats (2, E) -> (the block's output, stats plus this layer's)."""
        flat = x.reshape(-1, x.size(-1))
        logits, weights, experts = getattr(self, self.router_name)(flat)
        out = self.experts(flat, experts, weights)
        return out.view_as(x), stats + balance_stats(logits, experts)


# The load-balancing loss of every forward with targets, for the trainer's metrics (it is in the loss
# only with output_router_logits). Kept as detached tensors so recording never waits for the device.
_BALANCE: list[torch.Tensor] = []
_LOCK = threading.Lock()


def record_balance(aux: torch.Tensor) -> None:
    with _LOCK:
        _BALANCE.append(aux.detach())
        del _BALANCE[:-4096]  # nobody reading: keep the memory bounded


def take_balance() -> float | None:
    """The mean load-balancing loss of the microbatches since the last call (None: no MoE forward)."""
    with _LOCK:
        values, _BALANCE[:] = list(_BALANCE), []
    return float(torch.stack([v.float().cpu() for v in values]).mean()) if values else None

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


# The load-balancing loss of every forward with targets, for the trainer's metrics (it is in the loss only with
# output_router_logits): a running (sum, count) per device, added to by the forward itself, so a forward that
# the engine replays as a CUDA graph adds too (a Python record would run only while the graph records), and
# recording never waits for the device. A stage's warm-up runs before it is recorded add as well: the first step
# of each recorded input shape weighs its first microbatch a little more.
_SUMS: dict[torch.device, torch.Tensor] = {}
_LOCK = threading.Lock()


def record_balance(aux: torch.Tensor) -> None:
    with _LOCK:
        sums = _SUMS.get(aux.device)
        if sums is None:  # made by the first (eager) forward on the device, outside any graph's memory
            sums = _SUMS[aux.device] = torch.zeros(2, device=aux.device)
    sums[0].add_(aux.detach().float())
    sums[1].add_(1)


def take_balance() -> float | None:
    """The mean load-balancing loss of the forwards since the last call (None: no MoE forward)."""
    with _LOCK:
        every = list(_SUMS.values())
    if not every:
        return None
    total = torch.stack([s.cpu() for s in every]).sum(0)
    for s in every:
        s.zero_()
    return float(total[0] / total[1]) if total[1] else None

"""The experts of an MoE layer as grouped matrix multiplications over tokens sorted by expert.

Each (token, choice) pair is one row; the rows are sorted by expert so that every expert's rows are
contiguous, and one grouped GEMM (`torch._grouped_mm`, one kernel for all experts) multiplies each
group by its expert's matrix. Where the grouped kernel cannot run (an old torch, a dtype or an
alignment it refuses), the groups are padded to the largest and multiplied with one `bmm`. Neither
loops over experts in Python.

Weights are stored as transformers holds them in memory (so LoRA targets them by the same names):
`gate_up_proj` (E, 2I, D) and `down_proj` (E, D, I), gate rows before up rows (Qwen3-MoE, Mixtral);
GPT-OSS (`interleaved`): (E, D, 2I) with gate and up columns alternating, (E, I, D), and biases.
"""
from __future__ import annotations

import torch
from torch import nn

from rptrain.models.combine import combine, sum_rows
from rptrain.models.decoder_config import MoeConfig
from rptrain.models.gating import gated_activation

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands (tried on torch 2.14: CPU float32/bfloat16/float16,
    every row and column stride a multiple of 16 bytes; CUDA: bfloat16 on compute capability 9+, its
    grouped-GEMM kernel's documented case, not tried here)."""
    if not _HAS_GROUPED_MM or x.dtype != w.dtype:
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.size(-1), w.size(-1), w.size(-2)))


def _shapes_must_be_static(x: torch.Tensor) -> bool:
    """Whether nothing may be read back from the device: a CUDA graph is recording (a read fails there), or
    the meta device (nothing to read)."""
    return x.device.type == "meta" or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, group: torch.Tensor, max_rows: int) -> torch.Tensor:
    """x (rows, K) sorted by group, w (E, K, N), offsets (E,) int32 cumulative row counts, group (rows,) each
    row's group, max_rows a bound on any group's rows -> (rows, N): row r times w[group[r]]."""
    if _grouped_mm_runs(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]]).long()
    slot = torch.arange(x.size(0), device=x.device) - starts[group]
    # Padded to the largest group: reading its size is one host sync, the fallback's price. A CUDA graph cannot
    # read it while recording, so there the groups are padded to the bound, which every replay's routing meets.
    if _shapes_must_be_static(x):
        capacity = max(max_rows, 1)
    else:
        capacity = int(slot.max()) + 1 if x.size(0) else 1
    padded = x.new_zeros(w.size(0), capacity, x.size(-1)).index_put((group, slot), x)
    return torch.bmm(padded, w)[group, slot]


class _Dispatch(torch.autograd.Function):
    """Each token's row copied to its k places among the sorted rows. The backward sums each token's k rows'
    gradients (combine.sum_rows: one pass on CUDA, else a gather and a reduction), where index_select's own
    backward adds every row into x with atomics (and x[token]'s sorts the rows first)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return sum_rows(grad, inverse, ctx.top_k), None, None, None


# Columns of the ones block that adds an expert's bias to its rows: the grouped kernel's smallest aligned width.
_BIAS_K = 8


def group_bias(bias: torch.Tensor, offsets: torch.Tensor, group: torch.Tensor, max_rows: int) -> torch.Tensor:
    """bias (E, N) -> (rows, N): each sorted row's expert's bias, as a grouped GEMM of a block of ones with the
    bias (zero-padded to _BIAS_K rows), so the bias's gradient is the grouped weight-gradient GEMM: each
    expert's rows summed in fp32 in one kernel (bias[group]'s backward sorts all rows for index_put_)."""
    padded = torch.nn.functional.pad(bias.unsqueeze(1), (0, 0, 0, _BIAS_K - 1))
    ones = torch.ones(group.size(0), _BIAS_K, device=bias.device, dtype=bias.dtype)
    return grouped_mm(ones, padded, offsets, group, max_rows)


class Experts(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int, device=None, dtype=None):
        super().__init__()
        E, D, I = moe.n_experts, hidden_size, moe.expert_size
        self.n_experts, self.top_k, self.interleaved = E, moe.top_k, moe.interleaved
        self.activation, self.alpha, self.limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))  # noqa: E731
        self.gate_up_proj = empty(E, D, 2 * I) if moe.interleaved else empty(E, 2 * I, D)
        self.down_proj = empty(E, I, D) if moe.interleaved else empty(E, D, I)
        if moe.bias:
            self.gate_up_proj_bias, self.down_proj_bias = empty(E, 2 * I), empty(E, D)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gated_activation(gate_up, self.activation, self.alpha, self.limit)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, lora: dict | None = None) -> torch.Tensor:
        """x (N, D), experts and weights (N, k) -> (N, D): sum over k of weight * expert(x).

        lora: parameter name -> (a (E, in, r), b (E, r, out), scaling): each expert's low-rank update of that
        matrix (rptrain.models.lora.LoraExperts), applied to the sorted rows by two more grouped GEMMs."""
        choice = experts.flatten()
        order = choice.argsort(stable=True)
        group, token = choice[order], order // self.top_k
        counts = torch.zeros(self.n_experts, device=x.device, dtype=torch.int32)
        counts.index_add_(0, choice, torch.ones_like(choice, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        w_gate_up = self.gate_up_proj if self.interleaved else self.gate_up_proj.transpose(1, 2)
        w_down = self.down_proj if self.interleaved else self.down_proj.transpose(1, 2)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        rows = _Dispatch.apply(x, token, inverse, self.top_k)

        def project(inputs: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
            # A token's k choices are distinct experts: no expert gets more rows than there are tokens.
            mm = lambda rows_in, w: grouped_mm(rows_in, w, offsets, group, max_rows=x.size(0))  # noqa: E731
            out = mm(inputs, weight)
            if lora and name in lora:
                a, b, scaling = lora[name]
                # The scaling goes into b (E x r x out) rather than onto the (rows, out) update: one pass over the
                # update fewer, forward and backward. out is no operand of its GEMM's backward, so it takes the add.
                out = out.add_(mm(mm(inputs, a), b * scaling))
            return out

        h = project(rows, w_gate_up, "gate_up_proj")
        if hasattr(self, "gate_up_proj_bias"):
            h = h + group_bias(self.gate_up_proj_bias, offsets, group, x.size(0))
        y = project(self._gated(h), w_down, "down_proj")
        if hasattr(self, "down_proj_bias"):
            y = y + group_bias(self.down_proj_bias, offsets, group, x.size(0))
        return combine(y, weights, order, inverse)  # back to token order, each token's k outputs weighted and summed

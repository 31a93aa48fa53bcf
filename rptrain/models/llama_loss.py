"""Final RMSNorm + LM head + cross entropy, fused and chunked over tokens.

With a 128k vocabulary the full (tokens, vocab) logits of one microbatch can
outweigh the rest of the activations. Here only one chunk of
`loss_chunk_tokens` rows of logits exists at a time, and the gradients are
produced in the same pass while that chunk is at hand, so backward never has
to rebuild logits: it only scales the stored gradients.
"""

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100


def count_tokens(targets: torch.Tensor) -> int:
    """Tokens that contribute to the loss. Call it on CPU targets to avoid a device sync."""
    return int((targets != IGNORE_INDEX).sum())


class LinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of cross_entropy(hidden @ weight.T, targets), ignore_index -100.

    hidden: (N, D), weight: (V, D), targets: (N,). Logits and the loss are computed
    in float32 (float64 when the inputs are float64); matmuls run in the input dtype.
    `softcap` (Gemma-2's final_logit_softcapping): logits = softcap * tanh(logits / softcap).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, need_grad: bool, softcap: float | None = None):
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        want_h = need_grad and ctx.needs_input_grad[0]
        want_w = need_grad and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=acc_dtype) if want_w else None
        loss = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        for start in range(0, hidden.size(0), chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            t = targets[start : start + chunk_tokens]
            valid = t != IGNORE_INDEX
            safe_t = t.masked_fill(~valid, 0)  # any in-range id; masked out below
            logits = (h @ weight.t()).to(acc_dtype)
            if softcap is not None:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss += torch.where(valid, lse - target_logit, 0.0).sum()
            if want_h or want_w:
                # d loss / d logits = softmax - onehot(target), zero on ignored rows.
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(g.size(0), device=g.device), safe_t] -= 1.0
                if softcap is not None:  # d(c * tanh(z / c)) / dz = 1 - tanh^2
                    g = g.mul_(1 - capped.square())
                g = g.mul_(valid[:, None]).to(hidden.dtype)
                if want_h:
                    grad_h[start : start + chunk_tokens] = g @ weight
                if want_w:
                    if grad_w.dtype == g.dtype:
                        grad_w.addmm_(g.t(), h)
                    else:  # half-precision matmul, summed across chunks in float32
                        grad_w.add_(g.t() @ h)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * grad_loss.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None

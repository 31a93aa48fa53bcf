"""Final RMSNorm + LM head + cross entropy, fused and chunked over tokens.

With a 128k vocabulary the full (tokens, vocab) logits of one microbatch can
outweigh the rest of the activations. Here only one chunk of
`loss_chunk_tokens` rows of logits exists at a time, and the gradients are
produced in the same pass while that chunk is at hand, so backward never has
to rebuild logits: it only scales the stored gradients.
"""

import torch
from torch.autograd.function import once_differentiable

from rptrain.models.fused import kernel

IGNORE_INDEX = -100


def count_tokens(targets: torch.Tensor) -> int:
    """Tokens that contribute to the loss. Call it on CPU targets to avoid a device sync."""
    return int((targets != IGNORE_INDEX).sum())


def chunk_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None,
               want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of rows: (summed loss, d loss / d logits in h's dtype, or None unless want_grad).

    Compiled (model.fused), the matmul is followed by one reduction and one elementwise pass over the
    (n, V) logits in h's dtype, where eagerly every step below is a pass over float32 logits.
    """
    valid = targets != IGNORE_INDEX
    safe_t = targets.masked_fill(~valid, 0)  # any in-range id; masked out below
    logits = (h @ weight.t()).to(torch.promote_types(h.dtype, torch.float32))
    if softcap is not None:
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target_logit, 0.0).sum()
    if not want_grad:
        return loss, None
    # d loss / d logits = softmax - onehot(target), zero on ignored rows.
    g = logits.sub_(lse[:, None]).exp_()
    if torch.compiler.is_compiling():  # a comparison fuses into the one pass; the scatter below would end it
        g = g - (torch.arange(g.size(1), device=g.device) == safe_t[:, None]).to(g.dtype)
    else:  # eagerly, in place: no (n, V) mask
        g[torch.arange(g.size(0), device=g.device), safe_t] -= 1.0
    if softcap is not None:  # d(c * tanh(z / c)) / dz = 1 - tanh^2
        g = g.mul_(1 - capped.square())
    return loss, g.mul_(valid[:, None]).to(h.dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of cross_entropy(hidden @ weight.T, targets), ignore_index -100.

    hidden: (N, D), weight: (V, D), targets: (N,). Logits and the loss are computed
    in float32 (float64 when the inputs are float64); matmuls run in the input dtype.
    `softcap` (Gemma-2's final_logit_softcapping): logits = softcap * tanh(logits / softcap).
    `fused`: each chunk's elementwise work compiled (chunk_loss).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, need_grad: bool, softcap: float | None = None, fused: bool = False):
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        want_h = need_grad and ctx.needs_input_grad[0]
        want_w = need_grad and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=acc_dtype) if want_w else None
        loss = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        chunk = kernel(chunk_loss, fused)
        for start in range(0, hidden.size(0), chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            part, g = chunk(h, weight, targets[start : start + chunk_tokens], softcap, want_h or want_w)
            loss += part
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
        return grad_h, grad_w, None, None, None, None, None

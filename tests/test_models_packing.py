"""Packed sequences: several examples in one row, told apart by segment ids, train exactly like the
same examples run one by one (fp32, rel 1e-5): loss and every gradient, with sliding windows and
soft-capped attention too, alone and through the engine."""
from __future__ import annotations

import pytest
import torch

from reference import engine_gradients
from rptrain import ExecutePlan, RoundPipeRunConfig
from rptrain.models import IGNORE_INDEX
from rptrain.models.attention import _batch_block_mask, causal_attention, flex_attention, positions
from rptrain.models.decoder import build_decoder
from rptrain.models.decoder_config import DecoderConfig
from rptrain.models.rope import Rope

V = 53
ROWS = [[5, 7, 4], [9, 7], [16]]  # example lengths packed into rows of 16 tokens
VARIANTS = {
    "llama": dict(),
    "window": dict(sliding_window=3, sliding_layers=(True, False)),
    "gemma2_like": dict(norm_offset=True, sandwich_norms=True, attn_softcap=2.0, final_softcap=3.0, embed_scale=5.0,
                        activation="gelu_tanh", sliding_window=4, sliding_layers=(True, False), attn_scale=0.3),
    "qwen3_like": dict(qk_norm=True, qkv_bias=True, rope=Rope(theta=100.0, type="llama3", factor=4.0, original_max_position_embeddings=8)),
}


def model(variant: str, attention: str = "auto") -> torch.nn.Sequential:
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=V, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=48,
                        loss_chunk_tokens=5, attention=attention, **VARIANTS[variant])
    m = build_decoder(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from their init too
    return m


def examples(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (n for row in ROWS for n in row):
        ids = torch.randint(0, V, (length,), generator=g)
        targets = torch.randint(0, V, (length,), generator=g)
        targets[0] = IGNORE_INDEX
        out.append((ids, targets))
    return out


def packed(exs):
    """Rows of concatenated examples; segment ids count examples within a row (ids restart per row)."""
    ids, targets, segments, k = [], [], [], 0
    for row in ROWS:
        parts = exs[k:k + len(row)]
        k += len(row)
        ids.append(torch.cat([e[0] for e in parts]))
        targets.append(torch.cat([e[1] for e in parts]))
        segments.append(torch.cat([torch.full((n,), s) for s, n in enumerate(row)]))
    return torch.stack(ids), torch.stack(targets), torch.stack(segments)


def unpacked_loss_and_grads(m, exs):
    m.zero_grad()
    total = sum(m((ids[None], t[None])) for ids, t in exs)
    total.backward()
    return total.detach(), [p.grad.clone() for p in m.parameters()]


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_positions_restart_at_each_segment():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [7, 7, 3, 3, 7, 7]])
    assert positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 0, 1]]


@pytest.mark.parametrize("variant, attention", [(v, "auto") for v in sorted(VARIANTS)] + [("window", "flex"), ("window", "sdpa")])
def test_packed_equals_unpacked(variant, attention):
    """Every model.attention setting; on the CPU flex and auto run SDPA (FlexAttention has no CPU backward)."""
    m = model(variant, attention)
    exs = examples()
    expected_loss, expected = unpacked_loss_and_grads(m, exs)
    m.zero_grad()
    loss = m(packed(exs))
    loss.backward()
    assert abs(loss.item() - expected_loss.item()) <= 1e-5 * abs(expected_loss.item())
    for p, e in zip(m.parameters(), expected):
        assert rel(p.grad, e) < 1e-5
    # without segment ids the examples would see each other: the test can tell
    with torch.no_grad():
        ids, targets, _ = packed(exs)
        assert abs(m((ids, targets)).item() - expected_loss.item()) > 1e-3 * abs(expected_loss.item())


def test_packed_through_the_engine():
    m = model("gemma2_like")
    exs = examples(seed=1)
    _, expected = unpacked_loss_and_grads(m, exs)
    m.zero_grad()
    grads = engine_gradients(m, packed(exs), RoundPipeRunConfig(num_microbatch=3, execute_plan=ExecutePlan.from_cuts(4, [2], [1, 2])))
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected):
        assert rel(g, e) < 1e-5


@pytest.mark.parametrize("softcap, window", [(None, None), (2.0, 3)])
def test_flex_attention_matches_sdpa(softcap, window):
    """The CUDA FlexAttention path, run eagerly on the CPU (forward only there): same output as the SDPA path."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 16, 8), torch.randn(3, 2, 16, 8), torch.randn(3, 2, 16, 8)
    _, _, segments = packed(examples())
    expected = causal_attention(q, k, v, 0.3, softcap, window, segments)
    got = flex_attention(q, k, v, 0.3, softcap, window, segments, compiled=False)
    assert rel(got, expected) < 1e-5


def test_flex_block_mask_built_once_per_batch():
    """The layers of a stage share one block mask per window while the segments tensor is unchanged."""
    _, _, segments = packed(examples())
    first = _batch_block_mask(3, 16, "cpu", segments, None)
    assert _batch_block_mask(3, 16, "cpu", segments, None) is first
    assert _batch_block_mask(3, 16, "cpu", segments, 3) is not first  # another window, another mask
    assert _batch_block_mask(3, 16, "cpu", segments.clone(), None) is not first  # the next batch
    again = _batch_block_mask(3, 16, "cpu", segments, None)
    segments[0, :5] = 1  # written in place (a reused input buffer): rebuilt, and attention follows the new ids
    assert _batch_block_mask(3, 16, "cpu", segments, None) is not again
    q, k, v = torch.randn(3, 4, 16, 8), torch.randn(3, 2, 16, 8), torch.randn(3, 2, 16, 8)
    assert rel(flex_attention(q, k, v, segments=segments, compiled=False), causal_attention(q, k, v, segments=segments)) < 1e-5

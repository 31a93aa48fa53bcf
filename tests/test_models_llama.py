import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rptrain.models import (
    IGNORE_INDEX,
    LlamaConfig,
    build_llama,
    build_model,
    count_tokens,
    flops_per_token,
    list_models,
    llama_config,
    load_weights,
    parameter_count,
)
from rptrain.models.attention import causal_attention
from rptrain.models.decoder import DecoderBlock, LMHeadLoss, TokenEmbedding
from rptrain.models.hf_names import hf_name
from rptrain.models.llama import decoder_config
from rptrain.models.llama_loss import LinearCrossEntropy
from rptrain.models.rope import inverse_frequencies

TINY = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=40, max_seq_len=32, rope_theta=500.0)


def model_cfg(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**TINY, **overrides})


def tiny_model(seed=0, **overrides) -> nn.Sequential:
    torch.manual_seed(seed)
    model = build_llama(model_cfg(**overrides))
    with torch.no_grad():  # non-trivial norm weights so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def batch(cfg_or_model, B=2, T=12, n_ignored=3, seed=1):
    vocab = cfg_or_model[0].embed_tokens.weight.shape[0] if isinstance(cfg_or_model, nn.Sequential) else cfg_or_model
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    targets = torch.randint(0, vocab, (B, T), generator=g)
    targets.view(-1)[torch.randperm(B * T, generator=g)[:n_ignored]] = IGNORE_INDEX
    return ids, targets


# ---------------------------------------------------------------------------
# A plain single-module Llama written the obvious way, to check the Sequential.


def scaled_frequency(freq: float, cfg: LlamaConfig) -> float:
    """Llama 3.1's rotary scaling of one frequency, as Meta describes it, one number at a time."""
    if cfg.rope_scale_factor == 1:
        return freq
    wavelen = 2 * math.pi / freq
    if wavelen < cfg.rope_original_max_seq_len / cfg.rope_high_freq_factor:
        return freq
    if wavelen > cfg.rope_original_max_seq_len / cfg.rope_low_freq_factor:
        return freq / cfg.rope_scale_factor
    smooth = (cfg.rope_original_max_seq_len / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    return (1 - smooth) * freq / cfg.rope_scale_factor + smooth * freq


# The reference's parameter keys -> the Sequential layer's module names (transformers' names).
OURS = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm", "w1": "mlp.gate_proj", "w3": "mlp.up_proj",
        "w2": "mlp.down_proj"}


class ReferenceLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        D, F_, hd = cfg.dim, cfg.ffn_hidden, cfg.head_dim
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, D))
        self.layers = nn.ModuleList(
            nn.ParameterDict(
                {
                    "attn_norm": nn.Parameter(torch.zeros(D)),
                    "wq": nn.Parameter(torch.zeros(cfg.n_heads * hd, D)),
                    "wk": nn.Parameter(torch.zeros(cfg.n_kv_heads * hd, D)),
                    "wv": nn.Parameter(torch.zeros(cfg.n_kv_heads * hd, D)),
                    "wo": nn.Parameter(torch.zeros(D, cfg.n_heads * hd)),
                    "mlp_norm": nn.Parameter(torch.zeros(D)),
                    "w1": nn.Parameter(torch.zeros(F_, D)),
                    "w3": nn.Parameter(torch.zeros(F_, D)),
                    "w2": nn.Parameter(torch.zeros(D, F_)),
                }
            )
            for _ in range(cfg.n_layers)
        )
        self.norm = nn.Parameter(torch.zeros(D))
        self.head = None if cfg.tie_embeddings else nn.Parameter(torch.zeros(cfg.vocab_size, D))

    def pairs(self, model: nn.Sequential):
        """(reference parameter, Sequential parameter) pairs."""
        L = self.cfg.n_layers
        yield self.embed, model[0].embed_tokens.weight
        for i, layer in enumerate(self.layers):
            block = model[i + 1]
            for key, p in layer.items():
                yield p, block.get_submodule(OURS[key]).weight
        yield self.norm, model[L + 1].norm.weight
        if self.head is not None:
            yield self.head, model[L + 1].lm_head.weight

    def copy_from(self, model: nn.Sequential):
        with torch.no_grad():
            for ref, ours in self.pairs(model):
                ref.copy_(ours)

    def rms(self, x, w):
        x = x.float()
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.cfg.norm_eps))

    def rope(self, x):  # x: (B, H, T, hd); rotate (x[i], x[i + hd/2]) by pos * freq_i
        T, hd = x.shape[2], x.shape[3]
        freqs = torch.tensor([scaled_frequency(self.cfg.rope_theta ** (-2 * i / hd), self.cfg) for i in range(hd // 2)],
                             dtype=torch.float64)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * freqs
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, ids, targets):
        cfg = self.cfg
        B, T = ids.shape
        hd = cfg.head_dim
        x = self.embed[ids]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        for p in self.layers:
            a = self.rms(x, p["attn_norm"])
            q = (a @ p["wq"].T).view(B, T, cfg.n_heads, hd).transpose(1, 2)
            k = (a @ p["wk"].T).view(B, T, cfg.n_kv_heads, hd).transpose(1, 2)
            v = (a @ p["wv"].T).view(B, T, cfg.n_kv_heads, hd).transpose(1, 2)
            q, k = self.rope(q), self.rope(k)
            rep = cfg.n_heads // cfg.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, cfg.n_heads * hd)
            x = x + y @ p["wo"].T
            m = self.rms(x, p["mlp_norm"])
            x = x + (F.silu(m @ p["w1"].T) * (m @ p["w3"].T)) @ p["w2"].T
        x = self.rms(x, self.norm)
        head = self.embed if self.head is None else self.head
        logits = x @ head.T
        return F.cross_entropy(logits.view(-1, cfg.vocab_size).float(), targets.view(-1), reduction="sum")


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# head_dim 8 at theta 500: wavelengths 6.3, 30, 140 and 664 positions. With an original context of
# 64 they fall in all three of the scaling's bands (kept < 16 < blended < 64 < stretched).
SCALED = dict(rope_scale_factor=4.0, rope_original_max_seq_len=64)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rope", [{}, SCALED], ids=["rope", "scaled_rope"])
def test_matches_reference(tie, n_kv_heads, rope):
    model = tiny_model(tie_embeddings=tie, n_kv_heads=n_kv_heads, loss_chunk_tokens=7, **rope)
    ref = ReferenceLlama(model_cfg(tie_embeddings=tie, n_kv_heads=n_kv_heads, **rope))
    ref.copy_from(model)
    ids, targets = batch(model)

    loss = model((ids, targets))
    loss.backward()
    ref_loss = ref(ids, targets)
    ref_loss.backward()

    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for ref_p, p in ref.pairs(model):
        assert p.grad is not None
        assert rel_err(p.grad, ref_p.grad) < 1e-4


def test_rope_scaling_bands_and_presets():
    cfg = model_cfg(**SCALED)
    ours = inverse_frequencies(decoder_config(cfg).rope, cfg.head_dim, 0)[0].double()
    plain = [cfg.rope_theta ** (-2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]
    expected = torch.tensor([scaled_frequency(f, cfg) for f in plain], dtype=torch.float64)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    ratios = (torch.tensor(plain, dtype=torch.float64) / expected).tolist()
    assert ratios[0] == pytest.approx(1) and 1 < ratios[1] < 4 and ratios[2] == pytest.approx(4) and ratios[3] == pytest.approx(4)
    # The published Llama 3.2 / 3.1 settings, and none for the small presets.
    assert llama_config("llama_1b").rope_scaling == llama_config("llama_3b").rope_scaling == (32.0, 1.0, 4.0, 8192)
    assert llama_config("llama_8b").rope_scaling == (8.0, 1.0, 4.0, 8192)
    assert llama_config("llama_tiny").rope_scaling is None
    with pytest.raises(ValueError, match="rope_scale_factor"):
        model_cfg(rope_scale_factor=0.5)
    with pytest.raises(ValueError, match="low_freq"):
        model_cfg(rope_scale_factor=2.0, rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)


def test_tied_weights_are_one_parameter():
    model = tiny_model(tie_embeddings=True)
    assert model[-1].lm_head.weight is model[0].embed_tokens.weight
    distinct = list(model.parameters())  # deduplicated by nn.Module
    assert sum(p.numel() for p in distinct) == parameter_count(model_cfg(tie_embeddings=True))
    untied = tiny_model(tie_embeddings=False)
    assert untied[-1].lm_head.weight is not untied[0].embed_tokens.weight
    assert sum(p.numel() for p in untied.parameters()) == parameter_count(model_cfg(tie_embeddings=False))


def test_layers_hold_weights_only():
    model = tiny_model()
    assert isinstance(model[0], TokenEmbedding) and isinstance(model[-1], LMHeadLoss)
    assert all(isinstance(m, DecoderBlock) for m in model[1:-1])
    assert list(model.buffers()) == []
    names = {n for n, _ in model[1].named_parameters()}
    assert names == {f"{k}.weight" for k in OURS.values()}


def test_chunk_sizes_agree():
    ids, targets = batch(61, B=2, T=12)  # 24 tokens
    results = []
    for chunk in [5, 24, 1000]:
        model = tiny_model(loss_chunk_tokens=chunk)
        loss = model((ids, targets))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6)
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0, rtol=1e-5, atol=1e-6)  # only summation order differs


def test_loss_function_gradcheck():
    torch.manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([3, IGNORE_INDEX, 0, 10, 10, IGNORE_INDEX, 1])
    for chunk, softcap in [(3, None), (7, None), (100, None), (3, 1.5)]:  # 1.5: Gemma's final soft-capping, saturating
        fn = lambda h, w: LinearCrossEntropy.apply(h, w, targets, chunk, True, softcap)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_loss_function_matches_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 37, (50,))
    targets[::7] = IGNORE_INDEX
    loss = LinearCrossEntropy.apply(hidden, weight, targets, 8, True)
    (2.5 * loss).backward()  # a grad_output other than 1 must scale the stored grads
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, targets, reduction="sum")
    (2.5 * ref).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_ignore_index():
    model = tiny_model()
    ids, _ = batch(model)
    targets = torch.full_like(ids, IGNORE_INDEX)
    assert count_tokens(targets) == 0
    loss = model((ids, targets))
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad.abs().max() == 0 for p in model.parameters())

    # ignoring tokens = summing only over the kept ones
    model.zero_grad()
    ids, targets = batch(model, n_ignored=5)
    assert count_tokens(targets) == targets.numel() - 5
    loss = model((ids, targets))
    logits = model(ids)
    keep = targets != IGNORE_INDEX
    torch.testing.assert_close(loss, F.cross_entropy(logits[keep], targets[keep], reduction="sum"))


def test_no_grad_and_logits():
    model = tiny_model()
    ids, targets = batch(model)
    with torch.no_grad():
        loss = model((ids, targets))
        logits = model((ids, None))
    assert loss.grad_fn is None
    assert logits.shape == (*ids.shape, 61) and logits.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
    with torch.inference_mode():  # a rotary table cached here must still work with autograd later
        model((ids[:, :9], targets[:, :9]))
    model((ids[:, :9], targets[:, :9])).backward()


def test_grouped_query_attention_grouping():
    # Half precision goes through SDPA's enable_gqa, float32 through repeat_interleave:
    # both must pair query head i with kv head i // (n_heads / n_kv_heads).
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    full = causal_attention(q, k, v)
    half = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    torch.testing.assert_close(half.float(), full, rtol=0.05, atol=0.05)
    mask = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1)
    for h in range(6):
        kh, vh = k[:, h // 3], v[:, h // 3]
        att = torch.softmax((q[:, h] @ kh.transpose(-1, -2) / math.sqrt(8)).masked_fill(mask, float("-inf")), -1)
        torch.testing.assert_close(full[:, h], att @ vh, rtol=1e-5, atol=1e-5)


def test_causal():
    model = tiny_model()
    ids, _ = batch(model)
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 61
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("T", [1, 5, 32])
def test_sequence_lengths(T):
    model = tiny_model()
    ref = ReferenceLlama(model_cfg())
    ref.copy_from(model)
    ids, targets = batch(model, B=3, T=T, n_ignored=0)
    torch.testing.assert_close(model((ids, targets)), ref(ids, targets), rtol=1e-5, atol=1e-5)


def test_too_long_sequence_is_rejected():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    fp32 = tiny_model(seed=3)
    half = tiny_model(seed=3).to(dtype)
    ids, targets = batch(fp32)
    loss = half((ids, targets))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad.dtype == dtype and torch.isfinite(p.grad).all() for p in half.parameters())
    torch.testing.assert_close(loss, fp32((ids, targets)).detach(), rtol=2e-2, atol=0)
    built = build_model("llama_tiny", dtype=dtype)
    assert all(p.dtype == dtype for p in built.parameters())
    built((ids % 512, targets)).backward()


def test_init():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, dim=256, n_layers=8, n_heads=4, init_std=0.02)
    model = build_llama(cfg)
    block = model[1]
    assert abs(model[0].embed_tokens.weight.std().item() - 0.02) < 1e-3
    assert abs(block.self_attn.q_proj.weight.std().item() - 0.02) < 1e-3
    assert abs(block.mlp.down_proj.weight.std().item() - 0.02 / math.sqrt(16)) < 3e-4
    assert abs(block.self_attn.o_proj.weight.std().item() - 0.02 / math.sqrt(16)) < 3e-4
    assert torch.equal(block.input_layernorm.weight, torch.ones(256)) and torch.equal(model[-1].norm.weight, torch.ones(256))


def test_registry_and_presets():
    assert {"llama_tiny", "llama_125m", "llama_1b", "llama_3b", "llama_8b"} <= set(list_models())
    with pytest.raises(ValueError, match="llama_tiny"):
        build_model("llama_2b")

    tiny = build_model("llama_tiny")
    cfg = llama_config("llama_tiny")
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (512, 64, 2, 4, 2)
    assert sum(p.numel() for p in tiny.parameters()) == parameter_count(cfg)

    # Published sizes of Llama 3.2 1B / 3B and Llama 3.1 8B.
    assert parameter_count(llama_config("llama_1b")) == 1_235_814_400
    assert parameter_count(llama_config("llama_3b")) == 3_212_749_824
    assert parameter_count(llama_config("llama_8b")) == 8_030_261_248

    m = build_model("llama_8b", device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in m.parameters())
    assert sum(p.numel() for p in m.parameters()) == 8_030_261_248
    assert m[-1].lm_head.weight is not m[0].embed_tokens.weight

    small = build_model("llama_1b", vocab_size=259, max_seq_len=64, device="meta")
    assert small[0].embed_tokens.weight.shape == (259, 2048) and small[-1].lm_head.weight is small[0].embed_tokens.weight
    assert small[1].mlp.gate_proj.weight.shape == (8192, 2048) and small[1].self_attn.k_proj.weight.shape == (512, 2048)
    # overriding dim re-derives ffn_hidden where the preset does not pin it
    assert llama_config("llama_tiny", dim=128).ffn_hidden == 352


def test_flops_per_token():
    cfg = model_cfg()
    D, L, V, hd = cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.head_dim
    per_layer = D * 4 * hd + 2 * D * 2 * hd + 4 * hd * D + 3 * D * cfg.ffn_hidden
    assert flops_per_token(cfg, 16) == 6 * (L * per_layer + V * D) + 12 * L * D * 16
    assert flops_per_token(model_cfg(tie_embeddings=True), 16) == flops_per_token(cfg, 16)


# ---------------------------------------------------------------------------
# Checkpoint loading


def hf_names(model: nn.Sequential) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, as save_pretrained writes them (a tied head left out)."""
    L = len(model) - 2
    return {hf_name(k, L): v.detach().clone() for k, v in model.named_parameters()}


def assert_same_weights(a: nn.Sequential, b: nn.Sequential):
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_load_own_and_hf_names(tmp_path, tie):
    src, dst = tiny_model(seed=0, tie_embeddings=tie), tiny_model(seed=1, tie_embeddings=tie)
    torch.save(src.state_dict(), tmp_path / "own.pt")
    load_weights(dst, tmp_path / "own.pt")
    assert_same_weights(src, dst)

    dst = tiny_model(seed=2, tie_embeddings=tie)
    torch.save(hf_names(src), tmp_path / "pytorch_model.bin")
    load_weights(dst, tmp_path / "pytorch_model.bin")
    assert_same_weights(src, dst)
    if tie:
        assert dst[-1].lm_head.weight is dst[0].embed_tokens.weight


def test_load_casts_to_model_dtype(tmp_path):
    src = tiny_model(seed=0)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    dst = tiny_model(seed=1).to(torch.bfloat16)
    load_weights(dst, tmp_path / "w.pt")
    assert dst[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(dst[1].self_attn.q_proj.weight, src[1].self_attn.q_proj.weight.to(torch.bfloat16))


def test_load_errors(tmp_path):
    src = tiny_model()
    state = hf_names(src)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "bad.bin")
    with pytest.raises(ValueError, match=r"missing 1 \[2\.mlp\.up_proj\.weight\].*unexpected 1 \[2\.mlp\.extra"):
        load_weights(tiny_model(), tmp_path / "bad.bin")

    torch.save(hf_names(tiny_model(dim=64)), tmp_path / "wide.bin")
    with pytest.raises(ValueError, match="wrong shapes"):
        load_weights(tiny_model(), tmp_path / "wide.bin")

    # an untied checkpoint cannot silently go into a tied model
    torch.save(hf_names(tiny_model(tie_embeddings=False)), tmp_path / "untied.bin")
    with pytest.raises(ValueError, match="ties them"):
        load_weights(tiny_model(tie_embeddings=True), tmp_path / "untied.bin")
    # a tied checkpoint (no lm_head.weight) lacks a tensor for an untied model
    torch.save(hf_names(tiny_model(tie_embeddings=True)), tmp_path / "tied.bin")
    with pytest.raises(ValueError, match=r"missing 1 \[3\.lm_head\.weight\]"):
        load_weights(tiny_model(tie_embeddings=False), tmp_path / "tied.bin")

    with pytest.raises(FileNotFoundError):
        load_weights(tiny_model(), tmp_path / "nope.pt")


def test_load_safetensors_shards(tmp_path):
    save_file = pytest.importorskip("safetensors.torch").save_file
    src = tiny_model(seed=0, tie_embeddings=True)
    state = hf_names(src)
    keys = sorted(state)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({k: state[k] for k in keys[: len(keys) // 2]}, folder / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in keys[len(keys) // 2 :]}, folder / "model-00002-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text("{}")
    dst = tiny_model(seed=1, tie_embeddings=True)
    load_weights(dst, folder)
    assert_same_weights(src, dst)


def test_matches_hugging_face_llama(tmp_path):
    """HF weights load without q/k permutation because both use rotate_half."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    torch.save(hf.state_dict(), tmp_path / "hf.bin")
    ours = tiny_model(seed=5)
    load_weights(ours, tmp_path / "hf.bin")
    ids = torch.randint(0, 61, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-5)

"""model=hf: every supported family, built from a tiny random transformers checkpoint saved with
save_pretrained, computes the same logits, loss and gradients as transformers (fp32, rel 1e-5),
alone and through the engine; refused configs are one line."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers  # the reference (dev extra)

from reference import engine_gradients
from rptrain import ExecutePlan, RoundPipeRunConfig
from rptrain.models import IGNORE_INDEX, HFModelError, build_model
from rptrain.models.hf_config import decoder_config
from rptrain.models.hf_names import hf_name

V, T = 61, 12
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=3)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Each case: (config class, model class, settings); the window (5) is shorter than the sequence (12).
CASES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3, rope_theta=500.0)),
    "llama_linear_tied_bias": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                                       tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12, num_key_value_heads=1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict()),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                                        query_pre_attn_scalar=12, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=5, sliding_window_pattern=2, rope_local_base_freq=100.0,
                                                            final_logit_softcapping=4.0, query_pre_attn_scalar=12)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=6, head_dim=None)),
}
SHARDED = {"llama3", "gemma2", "phi3"}  # saved in several shards with model.safetensors.index.json


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def save_case(name: str, folder) -> torch.nn.Module:
    config_cls, model_cls, extra = CASES[name]
    settings = {**TINY, **extra}
    if settings.get("head_dim") is None:
        settings.pop("head_dim")
    config = getattr(transformers, config_cls)(**settings, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # every weight non-trivial, norms included
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder, max_shard_size="20KB" if name in SHARDED else "50GB")
    return model


def batch(seed: int = 1, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :3] = IGNORE_INDEX
    ids[1, 4] = TINY["pad_token_id"]  # its embedding row gets no gradient in either
    return ids, targets


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder, transformers model), each case saved once for the whole module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = folder, save_case(name, folder)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(saved, name):
    folder, theirs = saved(name)
    ours = build_model("hf", path=str(folder), loss_chunk_tokens=7)
    if name in SHARDED:
        assert (folder / "model.safetensors.index.json").is_file()
    ids, targets = batch()
    theirs.zero_grad()
    logits = theirs(ids).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    expected.backward()
    with torch.no_grad():
        assert rel(ours((ids, None)), logits.detach()) < 1e-5
    loss = ours((ids, targets))
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    hf_params = dict(theirs.named_parameters())
    L = len(ours) - 2
    for our_name, p in ours.named_parameters():
        ref = hf_params[hf_name(our_name, L)].grad
        assert rel(p.grad, ref) < 1e-5, our_name
    tied = theirs.config.tie_word_embeddings
    assert (ours[-1].lm_head.weight is ours[0].embed_tokens.weight) == tied


# A tied, a soft-capped and a fused family under two plans whose backward stages differ from the forward ones.
PLAN_A, PLAN_B = ExecutePlan.from_cuts(4, [3], [1, 3]), ExecutePlan.from_cuts(4, [1, 2], [2])


@pytest.mark.parametrize("name, plan", [("qwen2", PLAN_A), ("gemma2", PLAN_B), ("phi3", PLAN_A), ("phi3", PLAN_B)],
                         ids=["qwen2-a", "gemma2-b", "phi3-a", "phi3-b"])
def test_through_the_engine(saved, name, plan):
    folder, _ = saved(name)
    model = build_model("hf", path=str(folder))
    ids, targets = batch(B=4)
    model((ids, targets)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    grads = engine_gradients(model, (ids, targets), RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected):
        assert rel(g, e) < 1e-5


# Per family: a field changed in its saved config.json -> the fragments of the one-line refusal.
REFUSALS = [
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention=true (gemma3_text): rptrain trains causal decoders"),
    ("gemma2", dict(hidden_activation="gelu"), 'hidden_activation="gelu" (gemma2): rptrain supports gelu_pytorch_tanh'),
    ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "(qwen2): partial_rotary_factor other than 1 is supported for phi3 only"),
    ("phi3", dict(resid_pdrop=0.1), "resid_pdrop=0.1 (phi3): dropout is not supported"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope type 'longrope' is not supported"),
    ("mistral", dict(attention_bias=True), "attention_bias=true (mistral): this family has no attention biases in transformers"),
    ("qwen3", dict(layer_types=["full_attention", "chunked_attention"]), "layer_types="),
    ("llama3", dict(sliding_window=4), "sliding_window=4 (llama): rptrain does not know this field"),
]


@pytest.mark.parametrize("name, change, fragment", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_refusals(saved, name, change, fragment):
    folder, _ = saved(name)
    raw = {**json.loads((folder / "config.json").read_text()), **change}
    with pytest.raises(HFModelError) as info:
        decoder_config(raw)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message


def test_meta_build_checks_without_loading(saved, tmp_path):
    folder = shutil.copytree(saved("llama3")[0], tmp_path / "llama3")
    model = build_model("hf", path=str(folder), device="meta")
    assert all(p.is_meta for p in model.parameters())
    (folder / "config.json").write_text((folder / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3'))
    with pytest.raises(HFModelError, match=r"missing 9 \[model\.layers\.2\."):
        build_model("hf", path=str(folder), device="meta")

"""Mixture-of-experts families from config.json against transformers with the same weights (fp32, rel 1e-5):
logits, loss with the load-balancing term, every gradient (router included), the aux loss itself; alone
and through the engine with several microbatches and recompute, where the routing of the forward is replayed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from reference import engine_gradients
from rptrain import ExecutePlan, RoundPipeRunConfig
from rptrain.models import build_model
from rptrain.models.hf_export import hf_export
from rptrain.models.hf_names import hf_name
from rptrain.models.moe import take_balance
from test_models_hf import TINY, batch, rel

MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.3)
CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=True)),
    # 3 layers: layer 0 dense by mlp_only_layers, layer 1 dense by decoder_sparse_step=2, layer 2 MoE... and no renormalisation
    "qwen3_moe_sparse": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=False,
                                                                        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, sliding_window=5)),
    # sinks, sliding layer 0 and full layer 1, biased router and experts, clamped SwiGLU. YaRN as published: 4096 positions
    # stretched 32x to 131072 (a max_position_embeddings below the original makes transformers warn of an inconsistent
    # factor). The clamp at the published limit (7.0; transformers 5.17 hard-codes it, 5.25 reads swiglu_limit, as we
    # do), made to bite by larger expert weights (EXPERT_SCALE).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, sliding_window=5, max_position_embeddings=131072,
                                                                swiglu_limit=7.0)),
}
EXPERT_SCALE = {"gpt_oss": 40.0}  # gate/up pre-activations of std ~9: a good share beyond the limit of 7


def save_moe(name: str, folder) -> torch.nn.Module:
    config_cls, model_cls, extra = CASES[name]
    config = getattr(transformers, config_cls)(**{**TINY, **MOE, **extra}, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.2 * (EXPERT_SCALE.get(name, 1.0) if n.endswith("experts.gate_up_proj") else 1.0))
    model.save_pretrained(folder, max_shard_size="30KB")
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = folder, save_moe(name, folder)
        return cache[name]

    return get



@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(saved, name):
    folder, theirs = saved(name)
    ours = build_model("hf", path=str(folder), loss_chunk_tokens=7)
    ids, targets = batch()
    theirs.zero_grad()
    out = theirs(ids, output_router_logits=True)
    valid = (targets != -100).sum()
    ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), reduction="sum")
    expected = ce + theirs.config.router_aux_loss_coef * out.aux_loss * valid  # their mean loss, times the tokens
    expected.backward()
    with torch.no_grad():
        assert rel(ours((ids, None)), out.logits.detach()) < 1e-5
    take_balance()
    loss = ours((ids, targets))
    assert abs(take_balance() - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    loss.backward()
    hf_params = dict(theirs.named_parameters())
    L = len(ours) - 2
    for our_name, p in ours.named_parameters():
        assert rel(p.grad, hf_params[hf_name(our_name, L)].grad) < 1e-5, our_name


PLAN = ExecutePlan.from_cuts(4, [1, 2], [2])  # backward stages differ from the forward ones: layers are recomputed


# On CUDA the fused stage records as a CUDA graph: a MoE block that cannot (a device read) must not fall back silently.
@pytest.mark.filterwarnings("error:.*CUDA graph capture failed")
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_through_the_engine_with_replayed_routing(saved, monkeypatch, name):
    folder, _ = saved(name)
    model = build_model("hf", path=str(folder))
    ids, targets = batch(B=4)
    # Each microbatch is its own batch for the load-balancing term: the reference is the sum over microbatches.
    for i in range(2):
        model((ids[2 * i:2 * i + 2], targets[2 * i:2 * i + 2])).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    from rptrain.models import router

    calls = {"n": 0}
    original = router.doing_recompute

    def spy():
        calls["n"] += original()
        return original()

    monkeypatch.setattr(router, "doing_recompute", spy)
    grads = engine_gradients(model, (ids, targets), RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN))
    assert calls["n"] > 0  # routing was replayed in recomputed forwards
    for g, e in zip(grads, expected):
        assert rel(g, e) < 1e-5


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_several_microbatches_equal_transformers_per_microbatch(saved, name):
    """With several microbatches the load-balancing term is transformers' over each microbatch (one transformers
    forward per microbatch, as gradient accumulation runs it), weighted by the microbatch's target tokens. The
    whole-batch term is not separable: every microbatch's gradient needs the routing counts of all of them, and
    the fused last stage runs a microbatch's backward before the later ones have routed (docs/moe.md)."""
    folder, theirs = saved(name)
    ids, targets = batch(B=4)
    theirs.zero_grad()
    whole = theirs(ids, output_router_logits=True).aux_loss.item()
    weighted = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        out = theirs(ids[rows], output_router_logits=True)
        valid = (targets[rows] != -100).sum()
        ce = F.cross_entropy(out.logits.flatten(0, 1), targets[rows].flatten(), reduction="sum")
        (ce + theirs.config.router_aux_loss_coef * out.aux_loss * valid).backward()
        weighted += out.aux_loss.item() * valid.item() / (targets != -100).sum().item()
    assert abs(weighted - whole) > 1e-4 * whole  # the two definitions do differ on this batch
    model = build_model("hf", path=str(folder))
    grads = engine_gradients(model, (ids, targets), RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN))
    hf_params, L = dict(theirs.named_parameters()), len(model) - 2
    for (our_name, _), g in zip(model.named_parameters(), grads):
        assert rel(g, hf_params[hf_name(our_name, L)].grad) < 1e-5, our_name


def test_recompute_replays_the_forward_routing():
    """The experts chosen in the forward come back in the recompute even where the logits would now choose others."""
    from rptrain.engine.recompute import layer_call
    from rptrain.models.decoder_config import MoeConfig
    from rptrain.models.router import TopKRouter

    r = TopKRouter(MoeConfig(n_experts=4, top_k=2, expert_size=8, layers=(True,), norm_topk=True), 8)
    torch.nn.init.normal_(r.weight)
    x, store = torch.randn(5, 8), {}
    with layer_call(store, "layer", recomputing=False):
        _, weights, experts = r(x)
    with torch.no_grad():
        r.weight.neg_()  # the opposite preferences
    with layer_call(store, "layer", recomputing=True):
        logits, again_weights, again = r(x)
    assert torch.equal(again, experts) and not torch.equal(logits.topk(2).indices, experts)
    assert torch.allclose(again_weights.sum(-1), torch.ones(5))  # weights recomputed from the new logits, renormalised


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_greedy_generation_and_export(saved, tmp_path, name):
    """Greedy tokens equal transformers' (our KV cache, their generate); the export holds the source's tensors bit
    for bit, in the family's own layout (per-expert matrices, Mixtral's w1/w2/w3, GPT-OSS's fused experts)."""
    import json

    from transformers import AutoModelForCausalLM

    from rptrain.models.generate import generate
    from rptrain.models.hf_export import hf_export

    folder, theirs = saved(name)
    ours = build_model("hf", path=str(folder)).eval()
    prompt = [5, 9, 2, 33, 17, 40, 8]  # past the window of 5: the sliding layers' cache matters
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(ours, prompt, 8) == want[0, len(prompt):].tolist()
    out = hf_export(ours, json.loads((folder / "config.json").read_text()), tmp_path / "out", max_shard_bytes=30_000)
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    source = theirs.state_dict()
    assert back.state_dict().keys() == source.keys()
    assert all(torch.equal(t, source[k]) for k, t in back.state_dict().items())
    ids, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, theirs(ids).logits, rtol=0, atol=0)


REFUSALS = [
    ("qwen3_moe", dict(num_experts=8), "num_experts=8 (qwen3_moe): num_local_experts=4 says otherwise"),
    ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok 5 must be between 1 and the 4 experts"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window=true (qwen3_moe): rptrain does not train this family with sliding windows"),
    ("qwen3_moe", dict(mlp_only_layers=[0.5]), "mlp_only_layers=[0.5] (qwen3_moe): must be a list of integers"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 (mixtral): router jitter is not supported"),
    ("gpt_oss", dict(quantization_config={"quant_method": "bitsandbytes"}), "quantized weights (bitsandbytes) are not supported"),
    ("mixtral", dict(quantization_config={"quant_method": "mxfp4"}), "quantized weights (mxfp4) are not supported: save a bf16 copy"),
]


@pytest.mark.parametrize("name, change, fragment", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_refusals(saved, name, change, fragment):
    import json

    from rptrain.models import HFModelError
    from rptrain.models.hf_config import decoder_config

    folder, _ = saved(name)
    with pytest.raises(HFModelError) as info:
        decoder_config({**json.loads((folder / "config.json").read_text()), **change})
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_mxfp4_experts_are_dequantized_at_load(tmp_path):
    """A GPT-OSS folder whose experts are MXFP4 (as published): they load as transformers dequantizes them,
    and the export is plain weights transformers loads."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = transformers.GptOssConfig(**{**TINY, **MOE, "num_local_experts": 4, "intermediate_size": 64, "sliding_window": 5})
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path / "src")
    state = load_file(tmp_path / "src" / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    packed = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, rows = state.pop(name).shape
        packed[name] = (torch.randint(0, 256, (E, rows, n_in // 32, 16), dtype=torch.uint8, generator=g),
                        torch.randint(120, 130, (E, rows, n_in // 32), dtype=torch.uint8, generator=g))
        state[name + "_blocks"], state[name + "_scales"] = packed[name]
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((tmp_path / "src" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                      "model.embed_tokens", "lm_head"]}
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))
    ours = build_model("hf", path=str(tmp_path / "src"))
    params = {hf_name(n, len(ours) - 2): p for n, p in ours.named_parameters()}
    for name, (blocks, scales) in packed.items():
        assert torch.equal(params[name], convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)), name
    out = hf_export(ours, raw, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert all(torch.equal(p, params[n]) for n, p in back.named_parameters())


def test_gpt_oss_case_is_consistent_and_its_clamp_bites(saved, tmp_path):
    """The tiny GPT-OSS config means what the published one does (YaRN factor = max positions / original), and
    its clamped SwiGLU changes the logits: the equality above covers the clamp, not only the smooth part."""
    import json
    import shutil

    folder, theirs = saved("gpt_oss")
    raw = json.loads((folder / "config.json").read_text())
    rope = raw["rope_parameters"]
    assert raw["max_position_embeddings"] / rope["original_max_position_embeddings"] == rope["factor"] == 32
    assert raw["swiglu_limit"] == 7.0
    unclamped = shutil.copytree(folder, tmp_path / "unclamped")
    (unclamped / "config.json").write_text(json.dumps({**raw, "swiglu_limit": 1e9}))
    ids, _ = batch()
    with torch.no_grad():
        assert rel(build_model("hf", path=str(unclamped))((ids, None)), theirs(ids).logits) > 1e-2


@pytest.mark.parametrize("window, packed", [(None, False), (3, False), (None, True)])
def test_sink_attention_equals_the_written_out_softmax(window, packed):
    """GPT-OSS's sinks through SDPA (one more key) against the explicit softmax with the sink column, grouped
    query heads, fp32: output and the gradients of q, k, v and the sinks to rel 1e-5."""
    from rptrain.models.attention import attention_mask, explicit_attention, sink_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    segments = torch.tensor([[0] * 4 + [1] * 5, [0] * 9]) if packed else None
    mask = attention_mask(9, "cpu", segments, window)
    results = []
    for fn in (lambda: sink_attention(q, k, v, sinks, 0.3, None if window is None and not packed else mask),
               lambda: explicit_attention(q, k, v, mask, 0.3, None, sinks)):
        out = fn()
        grads = torch.autograd.grad((out * torch.arange(8.0)).sum(), (q, k, v, sinks))
        results.append((out, *grads))
    for ours, theirs in zip(*results):
        assert rel(ours, theirs) < 1e-5

"""LoRA against PEFT: the same tiny Llama (transformers' LlamaForCausalLM, saved and loaded into
rptrain's Sequential), the same adapter init (copied from PEFT's model), the same data. rptrain's
LoRA training through the engine matches PEFT + plain PyTorch in fp32 (losses and adapter weights,
rtol 1e-5, atol 1e-6) over async and sync steps; exported adapters load in PEFT and give rptrain's
logits; merged weights give the LoRA model's logits."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from hf_fixture import VOCAB, llama_folder
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.models import build_model, load_weights
from rptrain.models.lora import LoraLinear, apply_lora, merge_lora, target_modules
from rptrain.models.lora_export import adapter_state, save_adapter
from rptrain.optim import Adam
from test_engine_llama import batches

import peft
import transformers

RANK, ALPHA, LR = 4, 8.0, 1e-2
ASYNC = [True, True, True, False, False, False]  # step(is_async=...) per iteration


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("tiny_llama"), tie=False)


def rptrain_base(hf_dir) -> nn.Sequential:
    """The llama_tiny preset in the folder's shapes, its weights loaded from the folder."""
    model = build_model("llama_tiny", vocab_size=VOCAB, dim=32, ffn_hidden=64, n_heads=4, n_kv_heads=2, loss_chunk_tokens=16)
    load_weights(model, hf_dir)
    return model


def hf_base(hf_dir):
    return transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")


def peft_model(hf_dir, dropout: float = 0.0):
    torch.manual_seed(1)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=dropout, task_type="CAUSAL_LM",
                             target_modules=sorted(target_modules(["q", "k", "v", "o", "gate", "up", "down"])))
    return peft.get_peft_model(hf_base(hf_dir), config)


def rptrain_lora(hf_dir, reference) -> nn.Sequential:
    """rptrain's Sequential with the checkpoint loaded and PEFT's initial adapters copied in."""
    model = apply_lora(rptrain_base(hf_dir), RANK, ALPHA)
    theirs = peft.get_peft_model_state_dict(reference)
    mine = adapter_state(model)
    assert mine.keys() == theirs.keys()
    named = dict(model.named_parameters())
    with torch.no_grad():
        for k, name in zip(mine, [n for n in named if ".lora_" in n]):
            named[name].copy_(theirs[k])
    return model


def test_targets_map_onto_module_names_and_fused_modules():
    assert target_modules(["q", "v"]) == {"q_proj", "v_proj"}
    assert target_modules(["q", "k", "v", "gate", "up"]) >= {"qkv_proj", "gate_up_proj"}
    with pytest.raises(ValueError, match="allowed q, k, v"):
        target_modules(["query"])
    phi = nn.Sequential(nn.Module())
    phi[0].qkv_proj = nn.Linear(4, 12)
    with pytest.raises(ValueError, match="qkv_proj fuses q/k/v"):
        apply_lora(phi, 2, 4.0, targets=["q", "v"])
    apply_lora(phi, 2, 4.0, targets=["q", "k", "v"])  # wholly targeted: one adapter, as PEFT does
    assert isinstance(phi[0].qkv_proj, LoraLinear) and phi[0].qkv_proj.lora_B.weight.shape == (12, 2)
    with pytest.raises(ValueError, match="no nn.Linear named"):
        apply_lora(nn.Sequential(nn.Linear(2, 2)), 2, 4.0)


def test_init_is_peft_s_and_step_zero_is_the_base_model(hf_dir):
    torch.manual_seed(3)
    lora = LoraLinear(nn.Linear(64, 32, bias=False), RANK, ALPHA)
    bound = 1 / math.sqrt(64)  # kaiming_uniform_(a=sqrt(5)) over fan_in 64
    assert lora.lora_A.weight.abs().max() <= bound and lora.lora_A.weight.std() > bound / 3
    assert torch.count_nonzero(lora.lora_B.weight) == 0 and lora.scaling == ALPHA / RANK
    assert not lora.base_layer.weight.requires_grad and lora.lora_A.weight.requires_grad
    base = rptrain_base(hf_dir)
    model = apply_lora(copy.deepcopy(base), RANK, ALPHA, dropout=0.1)
    ids = torch.randint(0, VOCAB, (2, 8))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=0)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in dict(model.named_parameters()) if ".lora_" in n}


def test_lora_through_the_engine_matches_peft(hf_dir, tmp_path):
    reference = peft_model(hf_dir)
    model = rptrain_lora(hf_dir, reference)
    engine = RoundPipe(model)
    with OptimizerCtx():
        opt = Adam([p for p in engine.parameters() if p.requires_grad], lr=LR)
    # The reference: PEFT's model computes, an fp32 master copy of its adapters steps with torch's
    # fused Adam (elementwise the same as rptrain's), and the compute copy trails the master by one
    # step after an async step, as the engine's does.
    trainable = [p for p in reference.parameters() if p.requires_grad]
    master = [p.detach().clone().requires_grad_(True) for p in trainable]
    ref_opt = torch.optim.Adam(master, lr=LR, fused=True)
    history = [[p.detach().clone() for p in master]]
    cfg = RoundPipeRunConfig(num_microbatch=2)
    # The summed loss (not the mean): a few elements of lora_A get gradients near Adam's eps, where
    # rounding differences between transformers' and rptrain's kernels would show as 1e-4 relative.
    for i, ((x, y), is_async) in enumerate(zip(batches(len(ASYNC), vocab=VOCAB), ASYNC)):
        loss = engine.forward_backward(input_args=((x, y),), loss_fn=lambda out, _: out, run_config=cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        logits = reference(input_ids=x).logits
        expected = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5), i
        for pm, pc in zip(master, trainable):
            pm.grad, pc.grad = pc.grad.clone(), None
        ref_opt.step()
        ref_opt.zero_grad()
        history.append([p.detach().clone() for p in master])
        use = history[-1] if not is_async else history[max(len(history) - 2, 0)]
        with torch.no_grad():
            for pc, value in zip(trainable, use):
                pc.copy_(value)
    engine.synchronize()
    state = engine.state_dict()
    mine = adapter_state(model, state)
    theirs = dict(zip(peft.get_peft_model_state_dict(reference).keys(), master))
    assert mine.keys() == theirs.keys()
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k].detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert max(v.abs().max() for k, v in mine.items() if ".lora_B." in k) > 1e-3  # the adapters did train

    # Exported adapters load in PEFT and give rptrain's logits.
    save_adapter(model, tmp_path / "adapter", state=state)
    loaded = peft.PeftModel.from_pretrained(hf_base(hf_dir), tmp_path / "adapter")
    ids = batches(1, vocab=VOCAB)[0][0]
    with torch.no_grad():
        ours = engine(ids)
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5)
        # Merged weights: the same logits without the adapters.
        merged = merge_lora(copy.deepcopy(engine.model))
        assert not any(isinstance(m, LoraLinear) for m in merged.modules())
        torch.testing.assert_close(merged(ids), ours, rtol=1e-5, atol=1e-5)
    engine.close()


def test_phi3_fused_projections_take_one_adapter_each_as_in_peft(tmp_path):
    """Phi-3 (model=hf): qkv_proj and gate_up_proj are adapted whole; with the same (non-zero) adapters
    the logits are PEFT's (fp32, relative error 1e-5)."""
    from rptrain.models import build_model as build
    from test_models_hf import V, rel, save_case

    ref = save_case("phi3", tmp_path)
    theirs = peft.get_peft_model(ref, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=sorted(target_modules(["q", "k", "v", "o", "gate", "up", "down"]))))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model = apply_lora(build("hf", path=str(tmp_path)), RANK, ALPHA)
    assert {n.rpartition(".lora_A")[0].rpartition(".")[2] for n, _ in model.named_parameters() if ".lora_A." in n} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    state = peft.get_peft_model_state_dict(theirs)
    names = [n for n, _ in model.named_parameters() if ".lora_" in n]
    assert adapter_state(model).keys() == state.keys()
    with torch.no_grad():
        for name, key in zip(names, adapter_state(model)):  # both in the model's order
            dict(model.named_parameters())[name].copy_(state[key])
        ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
        assert rel(model.eval()(ids), theirs.eval()(input_ids=ids).logits) < 1e-5

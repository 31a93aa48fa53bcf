"""LoRA on MoE models against PEFT (peft 0.21's target_parameters on transformers' fused experts): the
adapters rptrain exports load in PEFT and give the same logits, loss and adapter gradients (fp32, rel 1e-5);
the merged weights give the adapted model's logits; the router is frozen unless train_router."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rptrain.models import build_model
from rptrain.models.hf_names import hf_name
from rptrain.models.lora import apply_lora, merge_lora
from rptrain.models.lora_export import PEFT_PREFIX, save_adapter
from test_models_hf import batch, rel
from test_models_hf_moe import save_moe

TARGETS = ["q", "o", "experts_gate_up", "experts_down"]


def adapted(folder, targets=TARGETS, **kw):
    model = apply_lora(build_model("hf", path=str(folder)), rank=4, alpha=8.0, targets=targets, **kw)
    torch.manual_seed(3)
    with torch.no_grad():  # non-zero B: the adapters change the model
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("name, targets", [("qwen3_moe", TARGETS), ("gpt_oss", TARGETS), ("mixtral", ["experts_down"])])
def test_adapters_match_peft(tmp_path, name, targets):
    from peft import PeftModel

    theirs = save_moe(name, tmp_path / "base")
    ours = adapted(tmp_path / "base", targets)
    save_adapter(ours, tmp_path / "adapter")
    theirs = PeftModel.from_pretrained(theirs, tmp_path / "adapter", is_trainable=True).eval()
    ids, targets_ = batch()
    out = theirs(input_ids=ids, output_router_logits=True)
    valid = (targets_ != -100).sum()
    expected = F.cross_entropy(out.logits.flatten(0, 1), targets_.flatten(), reduction="sum")
    expected = expected + theirs.config.router_aux_loss_coef * out.aux_loss * valid
    expected.backward()
    with torch.no_grad():
        assert rel(ours((ids, None)), out.logits.detach()) < 1e-5
    loss = ours((ids, targets_))
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    their_params = dict(theirs.named_parameters())
    L = len(ours) - 2
    from rptrain.models.lora_export import _peft_name

    state = ours.state_dict()
    trained = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n, _ in trained)
    for our_name, p in trained:
        peft_name = PEFT_PREFIX + hf_name(_peft_name(our_name, state), L).replace(".weight", ".default.weight")
        assert rel(p.grad, their_params[peft_name].grad) < 1e-5, our_name


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])  # (E, out, in) and GPT-OSS's (E, in, out) experts
def test_merged_experts_give_the_adapted_logits(tmp_path, name):
    from rptrain.models.lora import merged_state

    save_moe(name, tmp_path / "base")
    ours = adapted(tmp_path / "base").eval()
    ids, _ = batch()
    plain = build_model("hf", path=str(tmp_path / "base")).eval()
    plain.load_state_dict(merged_state(ours.state_dict(), 8.0 / 4))  # what a merged export writes
    with torch.no_grad():
        before = ours((ids, None))
        assert rel(plain((ids, None)), before) < 1e-5
        assert rel(merge_lora(ours)((ids, None)), before) < 1e-5


def test_router_frozen_unless_asked(tmp_path):
    save_moe("qwen3_moe", tmp_path / "base")
    frozen = adapted(tmp_path / "base")
    assert not any(p.requires_grad for n, p in frozen.named_parameters() if ".mlp.gate." in n)
    trained = adapted(tmp_path / "base", train_router=True)
    assert all(p.requires_grad for n, p in trained.named_parameters() if ".mlp.gate." in n)
    with pytest.raises(ValueError, match="adapters on experts take no dropout"):
        apply_lora(build_model("hf", path=str(tmp_path / "base")), 4, 8.0, 0.1, ["experts_down"])


def test_expert_adapters_through_the_engine(tmp_path):
    """Adapters on experts and attention, the router trained too: the engine's gradients (two microbatches,
    recomputed layers) equal plain autograd's on the same two microbatches."""
    from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig

    save_moe("qwen3_moe", tmp_path / "base")
    model = adapted(tmp_path / "base", train_router=True)
    ids, targets = batch(B=4)
    for i in range(2):
        model((ids[2 * i:2 * i + 2], targets[2 * i:2 * i + 2])).backward()
    expected = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    plan = ExecutePlan.from_cuts(4, [1, 2], [2])
    engine = RoundPipe(model)
    with OptimizerCtx():
        masters = [p for p in engine.parameters() if p.requires_grad]  # the frozen base has masters too, without grads
        opt = torch.optim.SGD(masters, lr=0.0)
    grads: list[torch.Tensor] = []
    engine.forward_backward(input_args=((ids, targets),), loss_fn=lambda out, _: out,
                            run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    engine.step(lambda: (grads.extend(p.grad.cpu().clone() for p in masters), opt.zero_grad()), is_async=False)
    engine.close()
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected):
        assert rel(g, e) < 1e-5

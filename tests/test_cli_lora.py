"""A LoRA run from the command line (model.lora.rank=4 on a tiny transformers Llama, model.weights=its
folder): a sweep trains 3 and 6 steps, a run resumed from the 3-step checkpoint reproduces the 6-step
losses exactly, the merged export (hf/) loads in transformers and the adapter export (adapter/) in
PEFT over the base folder, and model.weights=RUN_DIR seeds a plain model with the adapters folded in,
all giving the LoRA model's logits (fp32, rtol 1e-5)."""
from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_module
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hf_fixture import CORPUS, VOCAB, llama_folder
from rptrain.models.fused import kernel as fused_kernel
from rptrain.train import schema
from rptrain.train.checkpoint import load_checkpoint
from rptrain.train.model import build_model
from test_cli_helpers import explain, read_jsonl, rptrain_here, train_losses

MODEL = ["model=llama_tiny", "model.dim=32", "model.ffn_hidden=64", "model.n_heads=4", "model.n_kv_heads=2",
         f"model.vocab_size={VOCAB}", "model.lora.rank=4", "model.lora.alpha=8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = llama_folder(root / "base")
    (root / "corpus.txt").write_text(CORPUS * 8)
    common = [*MODEL, f"model.weights={base}", "data=text", f"data.path={root / 'corpus.txt'}", f"data.tokenizer={base}",
              "data.seq_len=16", "trainer.batch_size=4", "trainer.log_interval=1", "trainer.checkpoint_interval=3",
              "precision=fp32", "optim.optimizer.lr=1e-2"]
    proc = rptrain_here(["-m", *common, "trainer.max_steps=3,6", f"hydra.sweep.dir={root / 'sweep'}"], root)
    assert proc.returncode == 0, explain(proc)
    resumed = root / "resumed"
    proc = rptrain_here([*common, "trainer.max_steps=6", f"trainer.resume={root / 'sweep' / '0'}", "model.lora.export=adapter",
                    f"hydra.run.dir={resumed}"], root)
    assert proc.returncode == 0, explain(proc)
    return base, root / "sweep" / "1", resumed, common


def test_lora_resume_is_exact(runs):
    _, straight, resumed, _ = runs
    expected, again = train_losses(read_jsonl(straight / "metrics.jsonl")), train_losses(read_jsonl(resumed / "metrics.jsonl"))
    assert sorted(again) == list(range(1, 7))
    for step in range(1, 7):
        assert again[step] == pytest.approx(expected[step], abs=1e-6, rel=0), step


def test_merged_and_adapter_exports_give_the_lora_model_s_logits(runs):
    base, straight, resumed, common = runs
    assert not (resumed / "hf").exists() and not (straight / "adapter").exists()
    config = json.loads((resumed / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == str(base)
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=common)
    ours = build_model(cfg, torch.float32)
    state = load_checkpoint(straight / "checkpoints" / "last.pt")["model"]
    ours.load_state_dict(state)
    assert any(".lora_B." in k and t.abs().max() > 0 for k, t in state.items())  # the adapters trained
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(straight / "hf").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), resumed / "adapter").eval()
    # A LoRA run seeds a new run (model.weights=RUN_DIR) with its adapters folded in.
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        seeded = build_model(compose("config", overrides=[*common, f"model.weights={straight}", "model.lora.rank=0"]), torch.float32)
    with torch.no_grad():
        expected = ours.eval()(ids)
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapted(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(seeded.eval()(ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fused_lora_run_trains_like_the_eager_one(runs, tmp_path):
    """model.fused=true through the CLI with LoRA: the adapters wrap the linears, the compiled kernels run
    the norms, rotary, SwiGLU and the loss between them; the 3-step losses are the eager run's (fp32,
    rel 1e-5: compiled reductions sum in another order, tests/test_models_fused.py)."""
    from rptrain.models import decoder

    _, straight, _, common = runs
    asked = []
    with pytest.MonkeyPatch.context() as patch:  # the switch reaches the layers: they ask for compiled kernels
        patch.setattr(decoder, "kernel", lambda fn, fused: asked.append(fused) or fused_kernel(fn, fused))
        proc = rptrain_here([*common, "model.fused=true", "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'fused'}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert asked and all(asked)
    expected = train_losses(read_jsonl(straight.parent / "0" / "metrics.jsonl"))
    got = train_losses(read_jsonl(tmp_path / "fused" / "metrics.jsonl"))
    assert sorted(got) == [1, 2, 3]
    for step in range(1, 4):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step

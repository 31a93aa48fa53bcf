"""Round trip through the CLI: a tiny Llama trains a few steps on text with a Hugging Face tokenizer, the run
writes hf/, and transformers loads it with rptrain's logits (fp32, rel 1e-5); rptrain-export writes bf16 as the
exact cast of the master weights; model.weights=RUN_DIR seeds a model; bad export input is one line, exit 2.

One CLI run is shared by every test; rptrain's side of each comparison runs in this process."""
from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_fixture import CORPUS, llama_folder, tokenizer_folder
from rptrain.cli.export import export, main
from rptrain.models.hf_names import hf_name
from rptrain.train import schema
from rptrain.train.checkpoint import load_checkpoint, save_checkpoint
from rptrain.train.data import build_data
from rptrain.train.errors import CheckpointError
from rptrain.train.export import export_weights
from rptrain.train.model import build_model
from rptrain.train.run_weights import run_checkpoint, run_config
from test_cli_helpers import error_lines, explain, rptrain_here

MODEL = ["model=llama_tiny", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.tie_embeddings=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    tok = tokenizer_folder(root / "tok")
    (root / "corpus.txt").write_text(CORPUS * 8)
    run_dir = root / "run"
    proc = rptrain_here([*MODEL, "data=text", f"data.path={root / 'corpus.txt'}", f"data.tokenizer={tok}", "data.seq_len=16",
                    "trainer.batch_size=4", "trainer.max_steps=3", "precision=fp32", "optim.optimizer.lr=1e-2",
                    f"hydra.run.dir={run_dir}"], root)
    assert proc.returncode == 0, explain(proc)
    return run_dir, tok


@pytest.fixture(scope="module")
def make():
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))


def master_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


def test_run_writes_hf_folder_that_transformers_loads_with_our_logits(run, make):
    run_dir, tok = run
    hf = run_dir / "hf"
    ref = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert type(ref).__name__ == "LlamaForCausalLM" and ref.config.tie_word_embeddings and ref.dtype == torch.float32
    assert AutoTokenizer.from_pretrained(hf)(CORPUS)["input_ids"] == AutoTokenizer.from_pretrained(tok)(CORPUS)["input_ids"]
    generation = json.loads((hf / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}  # the tokenizer's <s>, </s>, <pad>
    # rptrain's model seeded from the run (model.weights=RUN_DIR) must give transformers' logits.
    cfg = make(*MODEL, f"model.weights={run_dir}", f"model.vocab_size={ref.config.vocab_size}")
    ours = build_model(cfg, torch.float32).eval()
    trained = master_weights(run_dir)
    assert all(torch.equal(t, trained[k]) for k, t in ours.state_dict().items())
    ids = torch.tensor([AutoTokenizer.from_pretrained(hf)(CORPUS)["input_ids"][:16]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_export_bf16_is_the_cast_of_the_master_weights(run, tmp_path):
    run_dir, _ = run
    out = export(str(run_dir / "checkpoints" / "last.pt"), str(tmp_path / "bf16"), "bf16")
    written = load_file(out / "model.safetensors")
    trained = master_weights(run_dir)
    n_layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    expected = {hf_name(k, n_layers): t for k, t in trained.items()}
    assert set(written) == set(expected) - {"lm_head.weight"}  # tied: written once
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, expected[k].to(torch.bfloat16)) for k, t in written.items())
    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == torch.bfloat16 and torch.equal(back.lm_head.weight, written["model.embed_tokens.weight"])


def test_a_run_seeds_only_its_own_model(run, make):
    run_dir, _ = run
    checkpoint = run_checkpoint(run_dir)
    assert checkpoint == run_dir / "checkpoints" / "last.pt" and run_checkpoint(run_dir / "hf" / "config.json") is None
    assert run_config(checkpoint, {}).model.dim == 32  # a checkpoint without its config: the run's .hydra/config.yaml
    with pytest.raises(CheckpointError, match="other shapes"):
        build_model(make("model=llama_tiny", f"model.weights={run_dir}"), torch.float32, device="meta", vocab_size=320)


def test_bad_export_input_is_one_line_exit_2(run, make, tmp_path, capsys):
    run_dir, _ = run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    resnet = OmegaConf.to_container(make("model=resnet18", "data=synthetic"), resolve=True, enum_to_str=True)
    save_checkpoint(tmp_path / "resnet.pt", {"model": {}, "config": resnet})
    cases = {
        (str(tmp_path / "resnet.pt"), str(tmp_path / "c")): "only language models",
        (str(tmp_path / "nothing"), str(tmp_path / "a")): "neither a run directory",
        (str(run_dir), str(tmp_path / "full")): "not an empty folder",
        (str(run_dir), str(tmp_path / "b"), "--dtype", "int8"): "invalid choice",
    }
    for args, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        lines = error_lines(capsys.readouterr().err)
        assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("rptrain-export: error:") and message in lines[0], lines
    assert not any((tmp_path / name).exists() for name in "abc")


def test_model_hf_uses_and_exports_its_own_folder(make, tmp_path):
    """model=hf: the tokenizer defaults to the folder's, and the export is the source architecture with our weights."""
    source = llama_folder(tmp_path / "src", tie=False)
    (tmp_path / "c.txt").write_text(CORPUS * 4)
    cfg = make("model=hf", f"model.path={source}", "data=text", f"data.path={tmp_path / 'c.txt'}", "data.seq_len=16",
               "trainer.batch_size=2", "precision=bf16")
    assert f"HFTokenizer({source / 'tokenizer.json'}" in build_data(cfg, torch.float32).description
    ours = build_model(cfg, torch.float32).eval()
    with torch.no_grad():
        ours[1].mlp.up_proj.weight.mul_(1.5)  # "trained": no longer the source's weights
    out = export_weights(cfg, ours.state_dict(), tmp_path / "hf", torch.float32)
    before, after = (json.loads((d / "config.json").read_text()) for d in (source, out))
    assert {k: v for k, v in after.items() if k not in ("torch_dtype", "dtype")} == {k: v for k, v in before.items() if k != "dtype"}
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1
    ref = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(out)(CORPUS)["input_ids"][:16]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)

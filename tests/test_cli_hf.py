"""`rptrain model=hf model.path=DIR`: a run from a Hugging Face folder, and every refusal (a config
field rptrain cannot honour, an unsupported architecture, missing weights) as one line, exit 2,
no run directory."""
from __future__ import annotations

import json
import shutil

import pytest
import transformers  # the reference (dev extra)
from test_cli_errors import cli, expect_error  # noqa: F401  (cli is a fixture)
from test_cli_helpers import error_lines, explain, read_jsonl, rptrain_here

DATA = ["data=synthetic_tokens", "data.vocab_size=64", "data.num_train=16", "data.num_val=8", "data.seq_len=16",
        "trainer.batch_size=4", "trainer.max_steps=2", "trainer.log_interval=1", "precision=fp32"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def edited(folder, tmp_path, **changes):
    """A copy of the folder whose config.json has `changes` (None deletes a key)."""
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_trains_a_hugging_face_folder(folder, tmp_path):
    run = tmp_path / "run"
    proc = rptrain_here(["model=hf", f"model.path={folder}", *DATA, f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    train = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 2 and all(r["loss"] > 0 for r in train)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "hf"
    # a refused config, end to end: one line, exit 2, no run directory
    bad = edited(folder, tmp_path, hidden_act="gelu")
    proc = rptrain_here(["model=hf", f"model.path={bad}", *DATA, f"hydra.run.dir={tmp_path / 'bad_run'}"], tmp_path)
    assert proc.returncode == 2, explain(proc)
    assert error_lines(proc.stderr) == [f"rptrain: error: {bad / 'config.json'}: hidden_act=\"gelu\" (llama): rptrain supports silu for this family"]
    assert not (tmp_path / "bad_run").exists()


REFUSED = {
    "rope": (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1], "short_factor": [1]}),
             ["rope_parameters=", "(llama)", "'longrope' is not supported", "default, linear, dynamic, yarn, llama3"]),
    "rope_key": (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 4}),
                 ["rope_parameters=", "beta_fast is not a linear rope setting", "supports factor"]),
    "dropout": (dict(attention_dropout=0.1), ["attention_dropout=0.1 (llama)", "dropout is not supported", "set it to 0.0"]),
    "unknown": (dict(rope_interleaved=True), ["rope_interleaved=true", "(llama)", "does not know this field", "attention_bias"]),
    "quantized": (dict(quantization_config={"bits": 4}), ["quantization_config=", "(llama)", "quantized weights (unknown method) are not supported"]),
    "types": (dict(hidden_size=32.5), ["hidden_size=32.5 (llama): must be a positive integer"]),
    "architecture": (dict(model_type="gpt2"), ['model_type="gpt2" is not supported', "llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3"]),
    "head": (dict(architectures=["LlamaForSequenceClassification"]), ["architectures=", "*ForCausalLM"]),
    "missing": (dict(hidden_size=None), ["hidden_size=(absent) (llama)", "is required"]),
    "shapes": (dict(intermediate_size=40), ["tensor shapes differ from config.json", "mlp.down_proj.weight (32, 48) vs (32, 40)"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(cli, folder, tmp_path, case):  # noqa: F811
    changes, fragments = REFUSED[case]
    expect_error(cli("model=hf", f"model.path={edited(folder, tmp_path, **changes)}", *DATA), *fragments)


def test_bad_folders(cli, folder, tmp_path):  # noqa: F811
    expect_error(cli("model=hf", *DATA), "model.path is required", "model.path=/path/to/hf_model")
    expect_error(cli("model=hf", f"model.path={tmp_path}", *DATA), f"model.path={tmp_path}: no config.json there")
    no_weights = edited(folder, tmp_path)
    (no_weights / "model.safetensors").unlink()
    expect_error(cli("model=hf", f"model.path={no_weights}", *DATA), "no *.safetensors weights")
    expect_error(cli("model=hf", f"model.path={folder}", *DATA, "data.seq_len=128"), "data.seq_len=128 is longer than", "64 positions")
    expect_error(cli("model=hf", f"model.path={folder}", *DATA, "data.vocab_size=100"), "the data has 100 token ids", "the model embeds 64")


def test_trains_exports_and_generates_an_moe_folder(tmp_path):
    """Qwen3-MoE end to end: trains with the load-balancing loss logged (train and eval records), exports in
    the per-expert layout transformers loads, and rptrain-generate answers from the export."""
    from transformers import AutoModelForCausalLM

    from hf_fixture import tokenizer_folder
    from rptrain.cli.generate import main as generate_main

    folder = tmp_path / "moe"
    config = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tokenizer_folder(folder)
    run = tmp_path / "run"
    data = [d for d in DATA if not d.startswith("data.vocab_size")]
    proc = rptrain_here(["model=hf", f"model.path={folder}", *data, "data.vocab_size=320", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    records = read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 and all(r["router_balance"] > 0 for r in train)  # num_experts_per_tok (2) when perfectly balanced
    assert any("router_balance" in r for r in records if r["kind"] == "eval")
    back = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    generate_main([str(run / "hf"), "The quick", "--raw", "--max-tokens", "3"])

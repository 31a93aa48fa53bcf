"""config.json is data from outside: every field is type-checked, the family record decides rotary
precedence as transformers does, and bad weights files are one line naming the file."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from rptrain.models import HFModelError, build_model
from rptrain.models.hf_config import decoder_config, read_config_json

BASE = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)

BAD_TYPES = [
    (dict(hidden_size=32.5), "hidden_size=32.5 (llama): must be a positive integer"),
    (dict(num_hidden_layers=True), "num_hidden_layers=true (llama): must be a positive integer"),
    (dict(vocab_size="61"), 'vocab_size="61" (llama): must be a positive integer'),
    (dict(rope_scaling="linear"), 'rope_scaling="linear" (llama): must be a JSON object'),
    (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), "its factor must be a finite number"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps=NaN (llama): must be a finite number"),
    (dict(tie_word_embeddings="false"), 'tie_word_embeddings="false" (llama): must be true or false'),
    (dict(attention_bias=1), "attention_bias=1 (llama): must be true or false"),
    (dict(architectures="LlamaForCausalLM"), 'architectures="LlamaForCausalLM" (llama): must be a list of strings'),
    (dict(head_dim=0), "head_dim=0 (llama): must be a positive integer"),
    (dict(pad_token_id=2.0), "pad_token_id=2.0 (llama): must be an integer"),
    (dict(architectures=["LlamaForSequenceClassification"]), "rptrain trains causal language models (*ForCausalLM) only"),
    # built one by one: a crafted 10**9 held the run for minutes (issue 31's campaign)
    (dict(num_hidden_layers=10**9), "num_hidden_layers=1000000000 (llama): must be a positive integer of at most 16,384"),
    (dict(num_attention_heads=10**9), "num_attention_heads=1000000000 (llama): must be a positive integer of at most 16,384"),
    (dict(model_type="mixtral", num_local_experts=10**9, num_experts_per_tok=2), "num_local_experts=1000000000 (mixtral): must be a positive"),
]


@pytest.mark.parametrize("change, fragment", BAD_TYPES, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(BAD_TYPES)])
def test_every_field_is_type_checked(change, fragment):
    with pytest.raises(HFModelError) as info:
        decoder_config({**BASE, **change})
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("text, fragment", [("[1, 2]", "holds a JSON list, not an object"), ('"llama"', "holds a JSON str"),
                                            ("{", "cannot be read as JSON")])
def test_config_json_that_is_not_an_object(tmp_path, text, fragment):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(HFModelError, match=fragment):
        read_config_json(tmp_path)
    with pytest.raises(HFModelError, match="holds a JSON list"):
        decoder_config([1, 2])


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    both = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 700.0}
    theirs = transformers.LlamaConfig(**{k: v for k, v in both.items() if k != "model_type"})
    rope = decoder_config(both).rope
    assert theirs.rope_parameters["rope_type"] == "linear" == rope.type
    assert rope.factor == theirs.rope_parameters["factor"] == 4.0
    assert rope.theta == theirs.rope_parameters["rope_theta"] == 700.0
    # An empty rope_scaling is no setting: rope_parameters stands (transformers: `rope_scaling or rope_parameters`).
    empty = {**both, "rope_scaling": {}}
    theirs = transformers.LlamaConfig(**{k: v for k, v in empty.items() if k != "model_type"})
    assert decoder_config(empty).rope.theta == theirs.rope_parameters["rope_theta"] == 500.0


@pytest.fixture()
def folder(tmp_path):
    from hf_fixture import llama_folder

    return llama_folder(tmp_path / "llama", layers=1)


def test_int32_weight_is_refused_not_cast(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFModelError, match=r"model\.safetensors: tensor model\.norm\.weight is I32, not a floating-point weight"):
        build_model("hf", path=str(folder), device="meta")


def test_truncated_shard_names_the_file(folder):
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(HFModelError) as info:
        build_model("hf", path=str(folder), device="meta")
    assert str(shard) in str(info.value) and "damaged or incomplete" in str(info.value)

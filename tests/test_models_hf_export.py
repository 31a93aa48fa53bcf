"""hf_export writes what transformers loads: the weights bit for bit (fp32, and bf16 as the cast), the
config, sharded or not, a tied head once. The model here holds a transformers Llama's own weights under
our Sequential names (hf_names), so the reference is the model the weights came from."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_fixture import llama_folder
from rptrain.models.hf_export import hf_export
from rptrain.models.hf_names import seq_name


def as_sequential(hf_model) -> nn.Sequential:
    """A Sequential whose parameters are hf_model's, named by the convention (a tied head left out)."""
    n = hf_model.config.num_hidden_layers
    seq = nn.Sequential(*[nn.Module() for _ in range(n + 2)])
    tied = hf_model.config.tie_word_embeddings
    for name, tensor in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        *path, leaf = seq_name(name, n).split(".")
        module = seq
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, nn.Parameter(tensor.detach().clone()))
    return seq


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def source(request, tmp_path_factory):
    folder = llama_folder(tmp_path_factory.mktemp("llama"), tie=request.param)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_fp32_round_trip_sharded(source, tmp_path):
    folder, ref = source
    config = json.loads((folder / "config.json").read_text())
    out = hf_export(as_sequential(ref), config, tmp_path / "out", tokenizer=folder, max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"} <= {p.name for p in out.iterdir()}
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.tie_word_embeddings == ref.config.tie_word_embeddings and back.dtype == torch.float32
    expected = ref.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(back, ids), logits(ref, ids), rtol=0, atol=0)  # the same weights: the same logits
    written = json.loads((out / "generation_config.json").read_text())
    assert written == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def test_bf16_export_is_the_cast(source, tmp_path):
    folder, ref = source
    config = json.loads((folder / "config.json").read_text())
    out = hf_export(as_sequential(ref), config, tmp_path / "bf16", dtype=torch.bfloat16)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == torch.bfloat16
    expected = ref.state_dict()
    for name, tensor in back.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_tied_head_written_once_and_mixed_dtypes_refused(tmp_path):
    folder = llama_folder(tmp_path / "src", tie=True, layers=1)
    ref = AutoModelForCausalLM.from_pretrained(folder)
    model = as_sequential(ref)
    out = hf_export(model, json.loads((folder / "config.json").read_text()), tmp_path / "out")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    model[1].self_attn.q_proj.weight.data = model[1].self_attn.q_proj.weight.data.half()
    with pytest.raises(ValueError, match="mixes dtypes"):
        hf_export(model, {"num_hidden_layers": 1}, tmp_path / "mixed")


def test_views_of_one_flat_buffer_stay_untied(tmp_path):
    """The engine's master weights are views into flat tensors: an untied head of the embedding's shape is not tied."""
    folder = llama_folder(tmp_path / "src", tie=False, layers=1)
    ref = AutoModelForCausalLM.from_pretrained(folder)
    state = as_sequential(ref).state_dict()
    flat = torch.cat([t.flatten() for t in state.values()])
    views, offset = {}, 0
    for name, t in state.items():
        views[name] = flat[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    out = hf_export(views, json.loads((folder / "config.json").read_text()), tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(out)
    assert not back.config.tie_word_embeddings
    assert all(torch.equal(t, ref.state_dict()[k]) for k, t in back.state_dict().items())


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])  # qkv bias + tied + sliding; soft-caps + sandwich norms; fused qkv/gate_up
def test_model_hf_families_export_as_they_loaded(tmp_path, family):
    """model=hf -> hf_export -> transformers: the source's own weights come back bit for bit, with our logits."""
    from test_models_hf import batch, save_case

    from rptrain.models import build_model

    source = save_case(family, tmp_path / "src")
    ours = build_model("hf", path=str(tmp_path / "src"), dtype=torch.float32).eval()
    out = hf_export(ours, json.loads((tmp_path / "src" / "config.json").read_text()), tmp_path / "out", max_shard_bytes=30_000)
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert all(torch.equal(t, source.state_dict()[k]) for k, t in back.state_dict().items())
    ids, _ = batch()
    torch.testing.assert_close(logits(back, ids), logits(source, ids), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), logits(back, ids), rtol=1e-5, atol=1e-5)


def test_streamed_shards_read_back_bit_for_bit_with_safetensors(tmp_path, monkeypatch):
    """The hand-written safetensors header and the chunked casts give what safetensors itself reads:
    every tensor equal to the source cast to the export dtype, bit for bit (several chunks per tensor,
    a transposed view, an empty tensor)."""
    from safetensors.torch import load_file

    from rptrain.models import hf_export as hx

    monkeypatch.setattr(hx, "CHUNK_ELEMENTS", 7)
    src = {"a": torch.randn(5, 9), "b": torch.randn(4, 6).t(), "c": torch.zeros(0), "d": torch.randn(3).to(torch.bfloat16)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hx.write_safetensors(src, tmp_path / "x.safetensors", dtype)
        back = load_file(tmp_path / "x.safetensors")
        assert list(back) == list(src)
        for k, t in src.items():
            assert back[k].dtype == dtype and torch.equal(back[k], t.to(dtype)), (k, dtype)


def test_a_shard_leaves_the_page_cache_as_it_is_written(tmp_path, monkeypatch):
    """Every SYNC_BYTES the written part of a shard is flushed and dropped from the page cache (an 8 B
    export's 5 GiB shards would otherwise wait in memory as dirty pages), up to the whole file at its end;
    the file is the same."""
    from safetensors.torch import load_file

    from rptrain.models import hf_export as hx

    dropped = []
    real = hx.drop_written
    monkeypatch.setattr(hx, "drop_written", lambda f, written: dropped.append(written) or real(f, written))
    monkeypatch.setattr(hx, "CHUNK_ELEMENTS", 100)
    monkeypatch.setattr(hx, "SYNC_BYTES", 1000)  # 2.5 chunks of fp32
    src = {"a": torch.randn(30, 40), "b": torch.randn(250)}  # 12 chunks and 3 chunks
    path = tmp_path / "x.safetensors"
    hx.write_safetensors(src, path, torch.float32)
    assert dropped[-1] == path.stat().st_size and dropped == sorted(dropped)
    assert len(dropped) == 6 and all(b - a >= 1000 for a, b in zip(dropped[:-2], dropped[1:-1]))
    back = load_file(path)
    assert all(torch.equal(back[k], t) for k, t in src.items())

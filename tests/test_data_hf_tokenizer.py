"""Hugging Face tokenizer folders against transformers' AutoTokenizer on the same files (ids must be equal)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from hydra import compose, initialize_config_module

from hf_fixture import CORPUS, EOS, PAD, tokenizer_folder
from rptrain.data import DataError, load_text_corpus, load_tokenizer
from rptrain.train import schema
from rptrain.train.data import build_data

TEXTS = [CORPUS, "jumps over <|im_start|> dozen zebras", "ünïcödé and emoji 🦊 fall back to bytes"]


@pytest.mark.parametrize("bos", ["post", None])
def test_documents_match_auto_tokenizer(tmp_path, bos):
    folder = tokenizer_folder(tmp_path, bos=bos)
    ours, ref = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.vocab_size == len(ref) and ours.eos_id == ref.eos_token_id and ours.pad_id == ref.pad_token_id
    assert ours.bos_id == ref.bos_token_id
    for text in TEXTS:
        framed = ref(text)["input_ids"]
        assert (framed[0] == ours.bos_id) == (bos == "post")
        assert ours.document(text) == framed + [ref.eos_token_id]  # EOS closes every document
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ours.document(text)) == ref.decode(framed, skip_special_tokens=True)


def test_add_bos_token_in_the_config_prepends_bos_once(tmp_path):
    # transformers 5 leaves BOS to tokenizer.json's post-processor; transformers 4's Llama tokenizers (and we)
    # also honour tokenizer_config's add_bos_token when the post-processor does not add it.
    ours = load_tokenizer(tokenizer_folder(tmp_path, bos="config"))
    plain = transformers.AutoTokenizer.from_pretrained(tmp_path)(CORPUS, add_special_tokens=False)["input_ids"]
    assert ours.add_bos and ours.document(CORPUS) == [ours.bos_id, *plain, ours.eos_id]


def test_config_added_tokens_eos_choice_and_file_path(tmp_path):
    extra = {"added_tokens_decoder": {"320": {"content": "<tool>", "special": True}, "321": {"content": "newword", "special": False}}}
    folder = tokenizer_folder(tmp_path, config=extra)
    ours, ref = load_tokenizer(folder / "tokenizer.json"), transformers.AutoTokenizer.from_pretrained(folder)
    text = "a <tool> call with newword inside"
    assert ours.vocab_size == len(ref) == 322
    assert ours.document(text) == ref(text)["input_ids"] + [ours.eos_id]
    assert ref.convert_ids_to_tokens(ours.encode(text)).count("<tool>") == 1
    assert load_tokenizer(folder, eos_token=PAD).eos_id == ref.pad_token_id  # data.eos_token wins over the config
    with pytest.raises(DataError, match="data.eos_token='<nope>' is not a token"):
        load_tokenizer(folder, eos_token="<nope>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<missing>"}))
    with pytest.raises(DataError, match="names eos_token '<missing>'"):
        load_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(DataError, match="could not read .*tokenizer_config.json"):
        load_tokenizer(folder)


def test_corpus_frames_each_document(tmp_path):
    ours = load_tokenizer(tokenizer_folder(tmp_path / "tok"))
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(TEXTS):
        (docs / f"{i}.txt").write_text(text)
    corpus = load_text_corpus(docs, ours, seq_len=8, val_fraction=0.0)
    stream = torch.cat([corpus.train[0][:1, 0], corpus.train[1].flatten()])  # the windows overlap by one token
    expected = [i for text in TEXTS for i in ours.document(text)]  # BOS text EOS, BOS text EOS, ...
    assert stream.tolist() == expected[: len(stream)] and len(expected) - len(stream) < 9


@pytest.fixture(scope="module")
def make():
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))


def test_data_tokenizer_folder_and_eos_token_keys(make, tmp_path):
    folder = tokenizer_folder(tmp_path / "tok")
    (tmp_path / "c.txt").write_text(CORPUS * 4)
    common = ["model=llama_tiny", "data=text", f"data.path={tmp_path / 'c.txt'}", "data.seq_len=8", "trainer.batch_size=2"]
    data = build_data(make(*common, f"data.tokenizer={folder}"), torch.float32)
    assert data.vocab_size == len(transformers.AutoTokenizer.from_pretrained(folder)) and "HFTokenizer" in data.description
    with pytest.raises(DataError, match="data.eos_token"):
        build_data(make(*common, f"data.tokenizer={folder}", "data.eos_token='<zzz>'"), torch.float32)
    with pytest.raises(DataError, match="byte tokenizer"):
        build_data(make(*common, f"data.eos_token='{EOS}'"), torch.float32)
    assert "ByteTokenizer" in build_data(make(*common), torch.float32).description  # null: the model's; a preset has none

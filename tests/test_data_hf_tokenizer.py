"""Hugging Face tokenizer folders against transformers' AutoTokenizer on the same files (ids must be equal)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from hydra import compose, initialize_config_module

from hf_fixture import CORPUS, EOS, PAD, tokenizer_folder
from rptrain.data import ByteTokenizer, DataError, load_text_corpus, load_tokenizer
from rptrain.data.byte_tokenizer_files import write_byte_tokenizer
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
    expected = [i for text in TEXTS for i in ours.document(text)]  # BOS text EOS, BOS text EOS, ...
    assert corpus.cache.tokens.tolist() == expected  # the token stream the windows are cut from


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


def test_byte_tokenizer_files_encode_as_the_byte_tokenizer(tmp_path):
    """What a byte-tokenizer run exports: transformers reads the ids and text ByteTokenizer makes."""
    folder = write_byte_tokenizer(tmp_path)
    ref, ours = transformers.AutoTokenizer.from_pretrained(folder), ByteTokenizer()
    assert (len(ref), ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (259, ours.bos_id, ours.eos_id, ours.pad_id)
    for text in [*TEXTS, "tabs\t and  spaces\r\n", ""]:
        assert ref(text)["input_ids"] == ours.encode(text) and ref.decode(ours.encode(text)) == text
    assert load_tokenizer(folder).document(CORPUS) == ours.document(CORPUS)


class _Spy:
    """A tokenizers.Tokenizer that records the length of every text it is asked to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("bos", ["post", None, "config"])
def test_a_long_document_is_tokenized_in_bounded_pieces_with_the_same_ids(tmp_path, monkeypatch, bos):
    """The 54 MB file that peaked at 11.5 GB, in proportion: a call never sees more than CHUNK_CHARS, the ids are one call's."""
    from rptrain.data import hf_tokenizer

    tok = load_tokenizer(tokenizer_folder(tmp_path, bos=bos))
    text = "\n".join(f"{i}: {CORPUS}" for i in range(400))  # ~100 k characters
    whole = tok.document(text)  # one call (the text is below the default CHUNK_CHARS)
    monkeypatch.setattr(hf_tokenizer, "CHUNK_CHARS", 4096)
    tok.tokenizer = spy = _Spy(tok.tokenizer)
    pieces = tok.document(text)
    assert list(map(int, pieces)) == whole
    assert max(spy.lengths) <= 4096 and len(spy.lengths) > len(text) // 4096


def test_a_tokenizer_that_changes_at_every_break_keeps_one_call(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, normalizers

    from rptrain.data import hf_tokenizer

    folder = tokenizer_folder(tmp_path, bos=None)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.normalizer = normalizers.Prepend("Z")  # every input gets a prefix: no break is safe
    tok.save(str(folder / "tokenizer.json"))
    ours = load_tokenizer(folder)
    text = "\n".join(f"{i}: {CORPUS}" for i in range(100))
    whole = ours.document(text)
    monkeypatch.setattr(hf_tokenizer, "CHUNK_CHARS", 2048)
    assert list(map(int, ours.document(text))) == whole

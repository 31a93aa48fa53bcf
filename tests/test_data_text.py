"""Tokenizers and packed text corpora."""
import sys

import pytest
import torch

from rptrain.data import ByteTokenizer, DataError, WindowLoader, get_tokenizer, load_text_corpus, load_tokenizer
from rptrain.models import IGNORE_INDEX

TEXT = "héllo wörld — 日本語テキスト 🙂\n\tend"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    wrapped = tok.encode(TEXT, bos=True, eos=True)
    assert wrapped[0] == tok.bos_id == 256 and wrapped[-1] == tok.eos_id == 257 and tok.pad_id == 258
    assert tok.decode(wrapped + [tok.pad_id]) == TEXT  # specials are dropped
    assert tok.decode(torch.tensor(ids)) == TEXT
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a truncated character decodes, it does not raise
    assert tok.vocab_size == 259 and isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="outside"):
        tok.decode([300])


def _corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second doc ü", encoding="utf-8")
    (root / "a.md").write_text("# first doc\n", encoding="utf-8")
    (root / "sub" / "c.txt").write_text("third " * 20, encoding="utf-8")
    (root / "notes.py").write_text("ignored = True")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("ignored too")
    (root / "empty.txt").write_text("")
    return root


def rows(windows):
    """Every window of a split, in order: (inputs, targets, segment_ids)."""
    return windows.batch(torch.arange(len(windows)))


def test_folder_corpus_is_sorted_packed_and_shifted(tmp_path):
    root = _corpus(tmp_path)
    tok = ByteTokenizer()
    corpus = load_text_corpus(root, tok, seq_len=8, val_fraction=0.0)
    assert [p.relative_to(root).as_posix() for p in corpus.files] == ["a.md", "b.txt", "empty.txt", "sub/c.txt"]
    stream, docs = [], []
    for d, text in enumerate(["# first doc\n", "second doc ü", "third " * 20]):  # empty file: no document, no EOS
        ids = tok.encode(text) + [tok.eos_id]
        stream, docs = stream + ids, docs + [d] * len(ids)
    assert corpus.num_tokens == len(stream)
    x, y, seg = rows(corpus.train)
    assert x.shape == y.shape == seg.shape == ((len(stream) - 1) // 8, 8) and x.dtype == y.dtype == torch.int64
    # Targets are the inputs shifted by one, except where the next token opens another document.
    nxt = torch.tensor(stream[1 : 8 * len(x) + 1]).view(-1, 8)
    crossing = torch.tensor([docs[i] != docs[i + 1] for i in range(8 * len(x))]).view(-1, 8)
    assert torch.equal(y, torch.where(crossing, IGNORE_INDEX, nxt)) and int(crossing.sum()) == 2
    # Windows overlap by one token, so inputs then the last target rebuild the stream.
    assert torch.cat([x.reshape(-1), y[-1, -1:]]).tolist() == stream[: 8 * len(x) + 1]
    # Segment ids: each window numbers its documents 1, 2, ... in order.
    first = torch.tensor(docs[: 8 * len(x)]).view(-1, 8)
    assert torch.equal(seg, first - first[:, :1] + 1)
    assert corpus.val is None
    # The token cache is the corpus folder's hidden .rptrain_cache, which corpus listings skip.
    assert corpus.cache.path.parent == root / ".rptrain_cache" and not corpus.cache.reused
    batches = list(WindowLoader(corpus.train, batch_size=2, seed=0).epoch(0))
    assert batches[0][0].shape == (2, 8) and len(batches) == len(x) // 2  # drop_last


def test_token_cache_is_reused_and_follows_changes(tmp_path):
    root = _corpus(tmp_path)
    tok = ByteTokenizer()
    first = load_text_corpus(root, tok, seq_len=8, val_fraction=0.2)
    calls = []
    original = tok.document
    tok.document = lambda text: calls.append(text) or original(text)
    second = load_text_corpus(root, tok, seq_len=8, val_fraction=0.2)
    assert second.cache.reused and calls == []  # nothing tokenized on the second start
    for a, b in [(first.train, second.train), (first.val, second.val)]:
        assert all(torch.equal(p, q) for p, q in zip(rows(a), rows(b)))
    loader = lambda c: list(WindowLoader(c.train, batch_size=3, seed=5).epoch(1))  # noqa: E731
    assert all(torch.equal(p, q) for bp, bq in zip(loader(first), loader(second)) for p, q in zip(bp, bq))
    assert isinstance(second.cache.tokens, __import__("numpy").memmap) and second.cache.tokens.dtype.name == "uint16"
    (root / "b.txt").write_text("second doc, edited", encoding="utf-8")
    third = load_text_corpus(root, tok, seq_len=8, val_fraction=0.2)
    assert not third.cache.reused and calls and third.cache.path != second.cache.path
    elsewhere = load_text_corpus(root, ByteTokenizer(), seq_len=8, val_fraction=0.2, cache_dir=tmp_path / "cache")
    assert elsewhere.cache.path.parent == tmp_path / "cache" and not elsewhere.cache.reused


def test_glob_picks_any_files(tmp_path):
    root = _corpus(tmp_path)
    corpus = load_text_corpus(root, ByteTokenizer(), seq_len=4, val_fraction=0.0, glob="**/*.py")
    assert [f.name for f in corpus.files] == ["notes.py"] and corpus.num_tokens == len("ignored = True") + 1
    with pytest.raises(DataError, match=r"no files matching data.glob=\*.csv"):
        load_text_corpus(root, ByteTokenizer(), seq_len=4, glob="*.csv")


def test_val_split_is_the_stream_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("abcdefghij" * 20)  # 200 bytes + EOS = 201 tokens
    corpus = load_text_corpus(path, ByteTokenizer(), seq_len=10, val_fraction=0.25)
    assert corpus.files == [path] and corpus.num_tokens == 201
    n_val = int(201 * 0.25)
    assert len(corpus.train) == (201 - n_val - 1) // 10
    val_x, val_y, _ = rows(corpus.val)
    assert val_x.shape == ((n_val - 1) // 10, 10)
    val_stream = (ByteTokenizer().encode("abcdefghij" * 20) + [257])[-n_val:]
    assert val_x[0].tolist() == val_stream[:10]
    assert val_y[-1].tolist() == val_stream[31:41]  # 4 windows; the last 9 tokens do not fill one


def test_text_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(DataError, match="does not exist"):
        load_text_corpus(tmp_path / "missing", tok, 8)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="no .txt or .md files"):
        load_text_corpus(tmp_path / "nothing", tok, 8)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_text_corpus(empty, tok, 8)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError) as info:
        load_text_corpus(short, tok, 64, val_fraction=0.0)
    assert str(short) in str(info.value) and "5 training tokens" in str(info.value) and "seq_len+1=65" in str(info.value)
    medium = tmp_path / "medium.txt"
    medium.write_text("x" * 100)
    with pytest.raises(DataError, match="validation split .* 10 tokens"):
        load_text_corpus(medium, tok, 16, val_fraction=0.1)
    with pytest.raises(DataError, match="val_fraction"):
        load_text_corpus(medium, tok, 16, val_fraction=1.0)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_text_corpus(latin1, tok, 2)


def test_load_tokenizer_without_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match="pip install tokenizers"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_load_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = load_tokenizer(path)
    assert tok.vocab_size == 4 and tok.eos_id == 1
    assert tok.encode("hello world") == [2, 3]
    assert tok.decode([2, 3, 1]) == "hello world"
    corpus_file = tmp_path / "c.txt"
    corpus_file.write_text("hello world " * 10)
    corpus = load_text_corpus(corpus_file, tok, seq_len=4, val_fraction=0.0)
    assert corpus.vocab_size == 4 and len(corpus.train) == 5
    with pytest.raises(DataError, match="data.eos_token"):
        load_tokenizer(path, eos_token="</s>")
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="could not read tokenizer"):
        load_tokenizer(bad)

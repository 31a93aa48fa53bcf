"""The data group -> loaders: dtypes, shapes, splits, tokenizers, and the device choice."""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

from rptrain.train import schema
from rptrain.train.data import augment_device, build_data
from rptrain.train.errors import ConfigError
from rptrain.train.model import build_model
from rptrain.train.validate import validate_config


@pytest.fixture(scope="module")
def make():
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_synthetic_images_come_augmented_in_the_compute_dtype(make, dtype):
    cfg = make("data=synthetic", "data.num_train=40", "data.num_test=10", "data.num_classes=5", "trainer.batch_size=16",
               "data.augment_device=cpu")
    data = build_data(cfg, dtype)
    assert len(data.train) == 3  # 40 images, batch 16, the tutorial keeps the short last batch
    images, labels = next(data.train.epoch(0))
    assert images.dtype == dtype and images.shape == (16, 3, 32, 32) and labels.dtype == torch.int64
    test_images, _ = next(data.eval.epoch(0))
    assert test_images.shape == (10, 3, 32, 32) and abs(float(test_images.float().mean())) < 3


def test_cuda_augmentation_needs_cuda(make):
    cfg = make("data=synthetic", "data.augment_device=cuda")
    if torch.cuda.is_available():
        validate_config(cfg)
        assert augment_device(cfg.data).type == "cuda"
    else:  # refused by the config check, before a run directory exists
        with pytest.raises(ConfigError, match="data.augment_device=cuda"):
            validate_config(cfg)
    auto = augment_device(make("data=synthetic").data)
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_synthetic_tokens_split_and_vocab(make):
    cfg = make("model=llama_tiny", "data=synthetic_tokens", "data.num_train=20", "data.num_val=4", "data.seq_len=16",
               "data.vocab_size=50", "trainer.batch_size=8")
    data = build_data(cfg, torch.float32)
    ids, targets = next(data.train.epoch(0))
    assert ids.shape == targets.shape == (8, 16) and torch.equal(ids[:, 1:], targets[:, :-1])
    assert data.vocab_size == 50 and len(data.eval.epoch(0).__next__()[0]) == 4
    model = build_model(cfg, torch.float32, device="meta", vocab_size=data.vocab_size)
    assert model[0].embed_tokens.weight.shape[0] == 50


def test_text_with_a_tokenizer_json(make, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    text = "the cat sat on the mat. the dog sat on the log. " * 50
    (tmp_path / "corpus.txt").write_text(text)
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = make("model=llama_tiny", "data=text", f"data.path={tmp_path / 'corpus.txt'}",
               f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.seq_len=8", "trainer.batch_size=4")
    data = build_data(cfg, torch.float32)
    assert data.vocab_size == tok.get_vocab_size() and "HFTokenizer" in data.description
    ids, targets, segments = next(data.train.epoch(0))
    assert int(ids.max()) < data.vocab_size and ids.shape == targets.shape == segments.shape == (4, 8)
    assert build_model(cfg, torch.float32, device="meta", vocab_size=data.vocab_size)[0].embed_tokens.weight.shape[0] == data.vocab_size

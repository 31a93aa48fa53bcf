"""Hugging Face folders for tests: a tiny byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json)
and a tiny transformers Llama saved with save_pretrained, both made on the spot (no downloads).

    tokenizer_folder(tmp_path)                      BOS from the post-processor, as Llama 3's
    tokenizer_folder(tmp_path, bos="config")        BOS from tokenizer_config's add_bos_token
    tokenizer_folder(tmp_path, bos=None, config={"chat_template": "..."})   no BOS, extra config keys
    llama_folder(tmp_path, tie=True)                a LlamaForCausalLM folder with that tokenizer
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "Pack my box with five dozen liquor jugs! How vexingly quick daft zebras jump.\n"
)
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIALS = [BOS, EOS, PAD, "<|im_start|>", "<|im_end|>"]
VOCAB = 320


@functools.lru_cache(maxsize=None)
def _trained() -> str:
    """The tokenizer.json text, trained once per process (BPE over bytes: every text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return tok.to_str()


def tokenizer_folder(folder: Path, bos: Optional[str] = "post", config: Optional[dict] = None) -> Path:
    """Write tokenizer.json + tokenizer_config.json into `folder`. bos: "post" (the post-processor prepends
    it), "config" (add_bos_token: true only) or None (no BOS, as Qwen's)."""
    from tokenizers import Tokenizer, processors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(_trained())
    if bos == "post":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(folder / "tokenizer.json"))
    settings = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=BOS if bos else None, eos_token=EOS, pad_token=PAD,
                    model_max_length=4096)
    if bos == "config":
        settings["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **(config or {})}, indent=2))
    return folder


def llama_folder(folder: Path, tie: bool = False, layers: int = 2, max_shard_size: Optional[str] = None, seed: int = 0) -> Path:
    """A random tiny LlamaForCausalLM (GQA, fp32) saved with save_pretrained, plus the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return tokenizer_folder(folder)

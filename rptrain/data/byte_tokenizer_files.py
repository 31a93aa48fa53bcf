"""The byte tokenizer as Hugging Face tokenizer files, so that a model trained on bytes exports whole.

tokenizer.json is a byte-level BPE without merges: each byte is one token whose id is the byte's value,
then BOS, EOS and PAD at 256-258, exactly ByteTokenizer's ids. Byte-level BPE spells byte b as a printable
character (the printable Latin-1 bytes as themselves, the others shifted past 255, in byte order).
"""
from __future__ import annotations

import json
from pathlib import Path

from .text import ByteTokenizer

SPECIAL = {ByteTokenizer.bos_id: "<|byte_bos|>", ByteTokenizer.eos_id: "<|byte_eos|>", ByteTokenizer.pad_id: "<|byte_pad|>"}


def byte_characters() -> dict[int, str]:
    """Byte -> the character byte-level BPE writes for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {b: chr(b) for b in printable}, 256
    for b in range(256):
        if b not in chars:
            chars[b], shifted = chr(shifted), shifted + 1
    return chars


def write_byte_tokenizer(folder: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json of ByteTokenizer in `folder`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in byte_characters().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIAL[i], special=True, normalized=False) for i in sorted(SPECIAL)])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=SPECIAL[ByteTokenizer.bos_id],
                  eos_token=SPECIAL[ByteTokenizer.eos_id], pad_token=SPECIAL[ByteTokenizer.pad_id], add_bos_token=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder

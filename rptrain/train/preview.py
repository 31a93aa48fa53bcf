"""`rptrain --preview data=chat ...`: the first conversations as the model will see them, before a run.

Each is rendered with the run's chat template and tokenizer, and the text of the tokens the loss
trains on (data.train_on) is marked ⟦like this⟧, so a wrong template, a wrong train_on or a
format read the wrong way shows before anything trains. Nothing is built besides the tokenizer,
nothing is written, no run directory is made.
"""
from __future__ import annotations

import itertools

from omegaconf import DictConfig

from rptrain.data.chat import encode_conversation
from rptrain.data.chat_formats import read_conversations

from .chat_export import template_line
from .data import _chat_tokenizer, chat_seq_len
from .errors import ConfigError
from .validate import check_inputs, validate_config

EXAMPLES = 3
OPEN, CLOSE = "⟦", "⟧"


def marked(text: str, offsets: list[tuple[int, int]], trained: list[bool]) -> str:
    """`text` with each run of trained tokens' characters between OPEN and CLOSE."""
    out, at = [], 0
    for on, group in itertools.groupby(zip(offsets, trained), key=lambda item: item[1]):
        spans = [span for span, _ in group]
        start, end = max(spans[0][0], at), max(spans[-1][1], at)
        if on and end > start:
            out += [text[at:start], OPEN, text[start:end], CLOSE]
            at = end
    return "".join(out) + text[at:]


def preview_config(cfg: DictConfig) -> str:
    validate_config(cfg)
    if cfg.data.name != "chat":
        raise ConfigError(f"--preview shows chat data (data=chat), not data={cfg.data.name}")
    check_inputs(cfg)
    tokenizer, template = _chat_tokenizer(cfg)
    seq_len, train_on = chat_seq_len(cfg), cfg.data.train_on.value
    lines = [template_line(template, tokenizer), f"data.train_on={train_on}: the tokens the loss trains on are marked {OPEN}...{CLOSE}"]
    for conv in itertools.islice(read_conversations(cfg.data.path, cfg.data.format.value), EXAMPLES):
        text = template.render(conv.messages, tools=conv.tools)[0]
        ids, offsets = tokenizer.encode_offsets(text)
        mask = encode_conversation(conv, tokenizer, template, train_on).mask
        cut = f", cut at data.max_seq_len={seq_len}" if len(ids) > seq_len + 1 else ""
        lines += [f"--- {conv.where}: {len(ids)} tokens, {sum(mask[1:])} trained{cut}", marked(text, offsets, mask)]
    return "\n".join(lines)

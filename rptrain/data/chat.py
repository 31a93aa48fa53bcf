"""Conversations -> token ids with a loss mask, then packed (or padded) rows for the loader.

Which tokens train (data.train_on):
  assistant   every assistant turn (default)
  completion  the last assistant turn only
  all         every token

Assistant turns are found in the rendered text, then mapped to tokens through the tokenizer's
character offsets (so a token that merges across a boundary is never split or lost):
  * `{% generation %}` blocks, when the template has them, mark the spans exactly;
  * otherwise the conversation is rendered up to each assistant turn with the generation prompt,
    and up to the end of that turn: the text between the two is the turn (trailing whitespace
    excluded: the model stops at the end-of-turn token, not after the newline behind it);
  * a template whose earlier turns render differently once more follow (Qwen3 drops reasoning from
    old turns) falls back to the turn's content plus the end-of-turn text the template writes.

An example of n tokens gives n - 1 positions: inputs ids[:-1], targets ids[1:] with IGNORE_INDEX
where the target token does not train. Packed rows hold several examples back to back; segment ids
(1, 2, ... per example in its row, 0 for padding) keep attention and rotary positions inside each example, and
no example's last token predicts the next one's first, because every pair is made inside an example.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from .chat_formats import Conversation
from .chat_template import ChatTemplate
from .errors import DataError
from .text import Tokenizer

IGNORE_INDEX = -100  # rptrain.models.IGNORE_INDEX (not imported: the data layer does not import models)
TRAIN_ON = ("assistant", "completion", "all")
TOO_LONG = ("truncate", "drop")


def assistant_spans(template: ChatTemplate, messages: list[dict], text: str, where: str,
                    tools: Optional[list] = None) -> list[tuple[int, int]]:
    """Character spans of `text` (the whole conversation, rendered without generation tags) that
    belong to assistant turns."""
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True, tools=tools)[0]
        upto = template.render(messages[: i + 1], tools=tools)[0]
        if text.startswith(prompt) and text.startswith(upto) and len(prompt) <= len(upto.rstrip()):
            spans.append((len(prompt), len(upto.rstrip())))
            continue
        spans.append(_content_span(m["content"], upto, text, spans[-1][1] if spans else 0, where, template))
    return spans


def _content_span(content: str, upto: str, text: str, after: int, where: str, template: ChatTemplate) -> tuple[int, int]:
    at = upto.rfind(content) if content else -1
    start = text.find(content, after) if content else -1
    if at < 0 or start < 0:
        raise DataError(
            f"{where}: cannot find an assistant turn in the text the chat template {template.name} renders: "
            f"give the template {{% generation %}} blocks, or set data.chat_template=chatml"
        )
    tail = upto[at + len(content):].rstrip()  # the end-of-turn text, e.g. <|im_end|>
    end = start + len(content)
    return start, end + len(tail) if text.startswith(tail, end) else end


@dataclass
class Example:
    ids: list[int]
    mask: list[bool]  # per token: does predicting it count in the loss

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(self.ids, dtype=torch.int64)
        keep = torch.tensor(self.mask[1:], dtype=torch.bool)
        return ids[:-1], torch.where(keep, ids[1:], IGNORE_INDEX)


def encode_conversation(
    conv: Conversation, tokenizer: Tokenizer, template: ChatTemplate, train_on: str = "assistant"
) -> Example:
    text, marked = template.render(conv.messages, tools=conv.tools)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON's "\ud800" escape alone: a lone surrogate, which no tokenizer takes
        raise DataError(f"{conv.where}: the conversation holds {err.object[err.start:err.end]!r}, half of a UTF-16 surrogate pair, "
                        f"which is not text: fix the record (escapes \\ud800-\\udfff come in pairs) or remove it") from None
    ids, offsets = tokenizer.encode_offsets(text)
    if train_on == "all":
        return Example(ids, [True] * len(ids))
    spans = marked or assistant_spans(template, conv.messages, text, conv.where, conv.tools)
    if train_on == "completion":
        spans = spans[-1:]
    mask = [any(s < b and e > a for a, b in spans) for s, e in offsets]
    return Example(ids, mask)


@dataclass
class ChatStats:
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0  # longer than max_seq_len with too_long=drop
    no_trainable: int = 0  # nothing left to learn (no assistant turn, or cut off by truncation)
    tokens: int = 0  # positions kept
    trained: int = 0  # positions whose target counts in the loss
    first_skipped: str = ""  # "file:line (why)" of the first conversation left out

    def skip(self, where: str, why: str) -> None:
        self.first_skipped = self.first_skipped or f"{where}: {why}"

    def line(self, max_seq_len: int, too_long: str) -> str:
        long = f"{self.truncated} truncated" if too_long == "truncate" else f"{self.dropped} dropped"
        first = f"; first skipped: {self.first_skipped}" if self.first_skipped else ""
        return (
            f"{self.conversations} conversations ({long} at data.max_seq_len={max_seq_len}, "
            f"{self.no_trainable} skipped with no trainable tokens{first}); {self.tokens} tokens, {self.trained} trained"
        )


@dataclass
class ChatExamples:
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, targets) per example, unpadded
    stats: ChatStats = field(default_factory=ChatStats)


def encode_all(
    conversations: Iterable[Conversation], tokenizer: Tokenizer, template: ChatTemplate,
    train_on: str, max_seq_len: int, too_long: str,
) -> ChatExamples:
    if train_on not in TRAIN_ON:
        raise DataError(f"data.train_on={train_on} is not one of {'|'.join(TRAIN_ON)}")
    if too_long not in TOO_LONG:
        raise DataError(f"data.too_long={too_long} is not one of {'|'.join(TOO_LONG)}")
    out = ChatExamples([])
    s = out.stats
    for conv in conversations:
        s.conversations += 1
        ex = encode_conversation(conv, tokenizer, template, train_on)
        cut = len(ex.ids) > max_seq_len + 1
        if cut:
            if too_long == "drop":
                s.dropped += 1
                s.skip(conv.where, f"{len(ex.ids)} tokens, longer than data.max_seq_len={max_seq_len} (data.too_long=drop)")
                continue
            s.truncated += 1
            ex = Example(ex.ids[: max_seq_len + 1], ex.mask[: max_seq_len + 1])
        inputs, targets = ex.pair()
        trained = int((targets != IGNORE_INDEX).sum())
        if trained == 0:
            s.no_trainable += 1
            s.skip(conv.where, _why_untrained(conv, train_on, cut))
            continue
        s.tokens += len(inputs)
        s.trained += trained
        out.pairs.append((inputs, targets))
    return out


def _why_untrained(conv: Conversation, train_on: str, truncated: bool) -> str:
    roles = sorted({m["role"] for m in conv.messages})
    if "assistant" not in roles:
        return f"no assistant turn (roles {', '.join(roles)}; data.train_on={train_on} trains assistant turns)"
    if truncated:
        return "its assistant turns start after data.max_seq_len (truncated)"
    return f"no token left to train on (data.train_on={train_on})"


def pack(pairs: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int, pad_id: int = 0) -> tuple[torch.Tensor, ...]:
    """Examples in rows of seq_len -> (inputs, targets, segment_ids). Best fit decreasing: longest
    first, each into the fullest row it still fits in (rows are shuffled by the loader anyway)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0])):
        size = len(pairs[i][0])
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            rows.append([])
            room, r = seq_len, len(rows) - 1
        else:
            room, r = free.pop(at)
        rows[r].append(i)
        bisect.insort(free, (room - size, r))
    n = len(rows)
    inputs = torch.full((n, seq_len), pad_id, dtype=torch.int64)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    segments = torch.zeros((n, seq_len), dtype=torch.int64)
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members, start=1):
            x, y = pairs[i]
            inputs[r, at : at + len(x)], targets[r, at : at + len(x)], segments[r, at : at + len(x)] = x, y, k
            at += len(x)
    return inputs, targets, segments


def pad(pairs: list[tuple[torch.Tensor, torch.Tensor]], seq_len: Optional[int] = None, pad_id: int = 0) -> tuple[torch.Tensor, ...]:
    """One example a row, right-padded to seq_len (default: the longest) -> (inputs, targets)."""
    seq_len = seq_len or max((len(x) for x, _ in pairs), default=0)
    inputs = torch.full((len(pairs), seq_len), pad_id, dtype=torch.int64)
    targets = torch.full((len(pairs), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for r, (x, y) in enumerate(pairs):
        inputs[r, : len(x)], targets[r, : len(y)] = x, y
    return inputs, targets

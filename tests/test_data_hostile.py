"""Hostile chat data and templates: one DataError naming the file, record or template, never a
RecursionError, TypeError or OverflowError, a hang or an out-of-memory kill."""
from __future__ import annotations

import time

import pytest

from rptrain.data import ByteTokenizer, DataError
from rptrain.data import chat_template
from rptrain.data.chat import encode_conversation
from rptrain.data.chat_formats import Conversation, read_conversations
from rptrain.data.chat_template import ChatTemplate


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_nested_100k_deep_is_one_data_error(tmp_path, suffix):
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / f"deep{suffix}"
    path.write_text('{"x": ' + deep + "}\n" if suffix == ".jsonl" else "[" + deep + "]")
    with pytest.raises(DataError, match=f"{path.name}.*nested deeper"):
        list(read_conversations(path))


def test_a_lone_surrogate_is_one_data_error(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok"}]}\n')
    [conv] = list(read_conversations(path))
    with pytest.raises(DataError, match=f"{path.name}:1: .*surrogate"):
        encode_conversation(conv, ByteTokenizer(), ChatTemplate(chat_template.CHATML))


@pytest.mark.parametrize("source, message", [
    ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    ("{{ 'x' * 10**9 }}", "more than a chat template may build"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{{ 'abcdefgh' * 100 }}{% endfor %}{% endfor %}", "rendered more than"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ ''.__class__.__mro__ }}", "failed on a conversation"),
])
def test_a_runaway_template_is_bounded(monkeypatch, source, message):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)
    monkeypatch.setattr(chat_template, "MAX_RENDERED_CHARS", 2**20)
    conv = Conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], "x.jsonl:1")
    start = time.monotonic()
    try:
        encode_conversation(conv, ByteTokenizer(), ChatTemplate(source, name="evil.jinja"))
        raised = None
    except DataError as err:
        raised = str(err)
    assert time.monotonic() - start < 5
    if message == "failed on a conversation" and raised is None:
        return  # the sandbox renders an unsafe attribute as undefined: nothing leaks either way
    assert raised is not None and "evil.jinja" in raised and message in raised and "\n" not in raised, raised


SLOW_TEMPLATE = """
import sys
from rptrain.data import ByteTokenizer, DataError, chat_template
from rptrain.data.chat import encode_conversation
from rptrain.data.chat_formats import Conversation
chat_template.RENDER_SECONDS = 1.0
conv = Conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], "x.jsonl:1")
source = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"  # 10^10 empty iterations
try:
    encode_conversation(conv, ByteTokenizer(), chat_template.ChatTemplate(source, name="evil.jinja"))
except DataError as err:
    print(err)
"""


@pytest.mark.slow
def test_a_template_that_never_ends_is_stopped_by_the_time_limit():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SLOW_TEMPLATE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "evil.jinja" in proc.stdout and "ran longer than 1 s" in proc.stdout, (proc.stdout, proc.stderr)

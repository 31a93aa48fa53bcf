"""Chat data: rendering and loss masks against transformers' apply_chat_template, formats, limits, packing."""
import json
import sys

import pytest
import torch

from chat_fixture import CHATML, CONVERSATIONS, LLAMA3, THINKING, make_tokenizer_dir, untagged
from rptrain.data import DataError
from rptrain.data.chat import IGNORE_INDEX, encode_all, encode_conversation, pack, pad
from rptrain.data.chat_formats import Conversation, read_conversations
from rptrain.data.chat_template import CHATML as DEFAULT_TEMPLATE
from rptrain.data.chat_template import ChatTemplate
from rptrain.data import ByteTokenizer, load_tokenizer
from rptrain.models import IGNORE_INDEX as MODEL_IGNORE_INDEX

transformers = pytest.importorskip("transformers")


def _ours(folder):
    return load_tokenizer(folder), ChatTemplate.for_tokenizer(folder / "tokenizer_config.json")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for name, template in [("chatml", CHATML), ("llama3", LLAMA3), ("thinking", THINKING)]:
        out[name] = (make_tokenizer_dir(root / name, template), make_tokenizer_dir(root / f"{name}_plain", untagged(template)))
    return out


@pytest.mark.parametrize("name", ["chatml", "llama3", "thinking"])
def test_ids_and_assistant_mask_match_apply_chat_template(folders, name):
    """ids: exactly apply_chat_template's (tokenize=True). Mask: transformers' assistant_masks of the template
    with {% generation %} blocks, which ours must reproduce both from those blocks and, on the same
    template without them, by rendering prefixes (thinking: the content fallback for earlier turns)."""
    tagged, plain = folders[name]
    reference = transformers.AutoTokenizer.from_pretrained(tagged)
    for folder in (tagged, plain):
        tok, template = _ours(folder)
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        for messages in CONVERSATIONS:
            ref = reference.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ex = encode_conversation(Conversation(messages, "test"), tok, template)
            assert ex.ids == hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == ref["input_ids"]
            assert [int(m) for m in ex.mask] == ref["assistant_masks"] and any(ex.mask)
            # The generation prompt renders as transformers renders it too.
            prompt = template.render(messages[:1], add_generation_prompt=True)[0]
            assert prompt == hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)


def test_train_on_completion_and_all(folders):
    tok, template = _ours(folders["chatml"][1])
    messages = CONVERSATIONS[1]  # two assistant turns
    every = encode_conversation(Conversation(messages, "t"), tok, template, "assistant").mask
    last = encode_conversation(Conversation(messages, "t"), tok, template, "completion").mask
    everything = encode_conversation(Conversation(messages, "t"), tok, template, "all").mask
    assert all(everything) and sum(last) < sum(every)
    first_turn_end = every.index(False, every.index(True))
    assert not any(last[:first_turn_end]) and last[first_turn_end:] == every[first_turn_end:]
    inputs, targets = encode_conversation(Conversation(messages, "t"), tok, template).pair()
    assert IGNORE_INDEX == MODEL_IGNORE_INDEX and len(inputs) == len(targets) == len(every) - 1
    kept = [i for i, m in enumerate(every[1:]) if m]
    assert torch.equal((targets != IGNORE_INDEX).nonzero().flatten(), torch.tensor(kept))


def test_formats_read_and_render_like_their_messages(tmp_path, folders):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"messages": CONVERSATIONS[1]},
        {"prompt": "1 + 1 =", "completion": " 2"},
        {"instruction": "Translate to German:", "input": "good morning", "output": "Guten Morgen."},
        {"instruction": "Say hi", "output": "hi"},
    ]) + "\n\n")
    (data / "b.json").write_text(json.dumps([{"prompt": [{"role": "user", "content": "q"}],
                                              "completion": [{"role": "assistant", "content": "a"}]}]))
    convs = list(read_conversations(data))
    assert [c.where.split("/")[-1] for c in convs] == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3", "a.jsonl:4", "b.json:item 1"]
    expected = [
        CONVERSATIONS[1],
        [{"role": "user", "content": "1 + 1 ="}, {"role": "assistant", "content": " 2"}],
        [{"role": "user", "content": "Translate to German:\n\ngood morning"}, {"role": "assistant", "content": "Guten Morgen."}],
        [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]
    assert [c.messages for c in convs] == expected
    hf = transformers.AutoTokenizer.from_pretrained(folders["llama3"][1])
    tok, template = _ours(folders["llama3"][1])
    for conv in convs:
        assert encode_conversation(conv, tok, template).ids == hf.apply_chat_template(conv.messages, tokenize=True, return_dict=True)["input_ids"]
    with pytest.raises(DataError, match="data.format=openai is not a chat format"):
        list(read_conversations(data, "openai"))


def test_parquet_rows_are_records(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "alpaca.parquet"
    pq.write_table(pa.Table.from_pylist([{"instruction": "Say hi", "input": "", "output": "hi"},
                                         {"instruction": "Add", "input": "1+1", "output": None}]), path)
    with pytest.raises(DataError, match=r"alpaca.parquet:row 2: field 'output' is missing or null"):
        list(read_conversations(path))
    first = next(iter(read_conversations(path)))
    assert first.messages == [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(DataError, match="needs pyarrow: pip install pyarrow"):
        list(read_conversations(path))


def test_default_template_is_chatml_without_one(tmp_path):
    folder = make_tokenizer_dir(tmp_path / "none", template=None)
    tok, template = _ours(folder)
    assert template.source == DEFAULT_TEMPLATE and "chatml" in template.name
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ex = encode_conversation(Conversation(CONVERSATIONS[0], "t"), tok, template)
    assert ex.ids == hf.apply_chat_template(CONVERSATIONS[0], chat_template=DEFAULT_TEMPLATE, tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode([i for i, m in zip(ex.ids, ex.mask) if m]) == "Paris."  # and <|im_end|>, a special token decode skips
    assert ex.ids[[i for i, m in enumerate(ex.mask) if m][-1]] == tok.token_id("<|im_end|>")  # learns to end its turn


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": 3}]}', r"bad.jsonl:2: field 'messages\[0\].content' must be a string, got int"),
    ('{"prompt": "x", "completion": null}', r"bad.jsonl:2: field 'completion' is missing or null"),
    ('{"prompt": "x", "completion": ["y"]}', r"bad.jsonl:2: field 'prompt' must be a non-empty list"),
    ('{"messages": [', r"bad.jsonl:2: not valid JSON"),
    ('{"text": "x"}', r"bad.jsonl:2: no known format"),
    ('{"messages": []}', r"bad.jsonl:2: field 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"bad.jsonl:2: field 'messages\[0\].content' is missing"),
    ('{"instruction": "x", "output": 1}', r"bad.jsonl:2: field 'output' must be a string, got int"),
])
def test_a_malformed_line_names_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        list(read_conversations(path))


def test_too_long_and_untrainable_examples_are_counted():
    tok, template = ByteTokenizer(), ChatTemplate(DEFAULT_TEMPLATE)
    convs = [Conversation(m, f"f:{i}") for i, m in enumerate([
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],  # 68 tokens
        [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "long"}],  # prompt alone > 80
        [{"role": "user", "content": "only a question"}],  # nothing to learn
        [{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": "y" * 40}],  # answer cut short
    ])]
    kept = encode_all(convs, tok, template, "assistant", max_seq_len=80, too_long="truncate")
    s = kept.stats
    assert (s.conversations, s.truncated, s.no_trainable, len(kept.pairs)) == (4, 2, 2, 2)
    assert all(len(x) <= 80 for x, _ in kept.pairs) and len(kept.pairs[1][0]) == 80
    assert s.trained == sum(int((y != IGNORE_INDEX).sum()) for _, y in kept.pairs)
    dropped = encode_all(convs, tok, template, "assistant", max_seq_len=80, too_long="drop")
    assert (dropped.stats.dropped, dropped.stats.no_trainable, len(dropped.pairs)) == (2, 1, 1)
    assert "2 dropped at data.max_seq_len=80" in dropped.stats.line(80, "drop")
    everything = encode_all(convs, tok, template, "all", max_seq_len=80, too_long="truncate")
    assert everything.stats.no_trainable == 0 and everything.stats.trained == everything.stats.tokens


def test_pack_keeps_examples_apart_and_pad_pads():
    pairs = [(torch.arange(n) + 10 * n, torch.where(torch.arange(n) % 2 == 0, torch.arange(n) + 1, IGNORE_INDEX)) for n in (5, 3, 7, 2, 8)]
    inputs, targets, segments = pack(pairs, seq_len=8)
    assert inputs.shape == targets.shape == segments.shape == (4, 8)
    # Best fit decreasing: 8 | 7 | 5 then 3 in the room the 5 left | 2 (no row has room 2 any more).
    assert segments.tolist() == [[1] * 8, [1] * 7 + [0], [1] * 5 + [2] * 3, [1] * 2 + [0] * 6]
    rebuilt = [(inputs[r][segments[r] == k], targets[r][segments[r] == k]) for r in range(4) for k in range(1, 3) if (segments[r] == k).any()]
    assert all(torch.equal(a, x) and torch.equal(b, y) for (a, b), (x, y) in zip(rebuilt, [pairs[i] for i in (4, 2, 0, 1, 3)]))
    assert (targets[segments == 0] == IGNORE_INDEX).all()
    x, y = pad(pairs)
    assert x.shape == (5, 8) and torch.equal(x[1, :3], pairs[1][0]) and (y[1, 3:] == IGNORE_INDEX).all()

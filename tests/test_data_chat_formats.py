"""ShareGPT and OpenAI tool-calling records, rendered as transformers' apply_chat_template renders the same
messages (ids exact, assistant mask = transformers' assistant_masks), and the first skipped record named."""
from __future__ import annotations

import json

import pytest

from chat_fixture import make_tokenizer_dir
from rptrain.data import load_tokenizer
from rptrain.data.chat import encode_all, encode_conversation
from rptrain.data.chat_formats import read_conversations
from rptrain.data.chat_template import ChatTemplate
from rptrain.data.errors import DataError

transformers = pytest.importorskip("transformers")

# A tool-calling ChatML template in the style of Qwen2.5's: the tools' schemas in the system turn,
# assistant tool calls as <tool_call> JSON, tool answers as user-side <tool_response> turns.
TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- 'Tools:' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- generation %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>' }}
{%- endgeneration %}
{{- '\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
OPENAI = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny, 21 degrees."},
    ],
}
SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Capital of France?"},
                              {"from": "gpt", "value": "Paris."}, {"from": "human", "value": "And Spain?"},
                              {"from": "gpt", "value": "Madrid."}]}


@pytest.fixture(scope="module")
def tools_folder(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tools"), TOOLS_TEMPLATE)


def _write(path, *records) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_sharegpt_and_openai_tool_calls_render_as_apply_chat_template(tools_folder, tmp_path):
    data = _write(tmp_path / "mixed.jsonl", SHAREGPT, OPENAI)
    convs = list(read_conversations(data))
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert convs[0].tools is None and convs[1].tools == [WEATHER]
    reference = transformers.AutoTokenizer.from_pretrained(tools_folder)
    tok, template = load_tokenizer(tools_folder), ChatTemplate.for_tokenizer(tools_folder / "tokenizer_config.json")
    expected = [[{"role": m["from"].replace("human", "user").replace("gpt", "assistant"), "content": m["value"]}
                 for m in SHAREGPT["conversations"]], OPENAI["messages"]]
    for conv, messages, tools in zip(convs, expected, (None, OPENAI["tools"])):
        ref = reference.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ex = encode_conversation(conv, tok, template)
        assert ex.ids == ref["input_ids"]
        assert [int(m) for m in ex.mask] == ref["assistant_masks"] and any(ex.mask)
    text = template.render(convs[1].messages, tools=convs[1].tools)[0]
    assert '"name": "weather"' in text and "<tool_response>sunny, 21 C</tool_response>" in text


@pytest.mark.parametrize("record, message", [
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]},
     r"field 'conversations\[1\].from' is 'robot': expected one of system, human"),
    ({"conversations": [{"from": "human"}]}, r"field 'conversations\[0\]' must be an object with 'from' and 'value'"),
    ({"messages": [{"role": "assistant", "content": None}]}, r"field 'messages\[0\].content' must be a string, got NoneType"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {}}]}]}, r"tool_calls' must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "{not json"}, r"field 'tools' is a string but not JSON"),
])
def test_bad_records_name_the_field(tmp_path, record, message):
    with pytest.raises(DataError, match=message):
        list(read_conversations(_write(tmp_path / "bad.jsonl", record)))


def test_the_first_skipped_record_is_named_with_its_reason(tools_folder, tmp_path):
    data = _write(tmp_path / "d.jsonl", SHAREGPT, {"messages": [{"role": "user", "content": "only a question"}]},
                  {"messages": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]})
    tok, template = load_tokenizer(tools_folder), ChatTemplate.for_tokenizer(tools_folder / "tokenizer_config.json")
    stats = encode_all(read_conversations(data), tok, template, "assistant", 256, "truncate").stats
    assert stats.no_trainable == 2  # the second record, and the third (human/gpt are not roles of the messages format)
    assert f"first skipped: {data}:2: no assistant turn (roles user; data.train_on=assistant trains assistant turns)" in stats.line(256, "truncate")

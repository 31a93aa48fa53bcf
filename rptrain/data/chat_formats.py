"""Chat and instruction records from JSON Lines, JSON arrays or Parquet, as lists of messages.

Formats (data.format; `auto` tells them apart by their keys, record by record):
  messages           {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
                     OpenAI's tool calling too: an assistant turn with "tool_calls" (content may be
                     null), "tool" turns answering them ("tool_call_id", "name"), and the record's
                     "tools" (the function schemas), all handed to the chat template as transformers does
  sharegpt           {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
                     (also "user"/"assistant", and "function_call"/"observation" -> assistant/tool)
  prompt_completion  {"prompt": "...", "completion": "..."}  -> user, assistant
                     (prompt and completion may also be lists of messages, as TRL writes them)
  alpaca             {"instruction": "...", "input": "...", "output": "..."}
                     -> user: instruction + blank line + input (when not empty), assistant: output

A malformed record raises DataError naming the file, the line (row, item) and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")
FORMATS = ("auto", "messages", "sharegpt", "prompt_completion", "alpaca")
KEYS = {"messages": ("messages",), "sharegpt": ("conversations",), "prompt_completion": ("prompt", "completion"),
        "alpaca": ("instruction", "output")}
# ShareGPT's speakers (and the aliases other exports use) -> chat template roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}


@dataclass
class Conversation:
    messages: list[dict]
    where: str  # "file:line", for messages about this record
    tools: Optional[list] = None  # OpenAI-style function schemas, the template's `tools`


def chat_files(path: str | Path) -> list[Path]:
    """`path` itself, or every .jsonl/.json/.parquet file under it (hidden ones skipped), sorted."""
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"chat data {root} does not exist: set data.path to a .jsonl/.json/.parquet file or a folder of them")
    files = sorted(
        (f for f in root.rglob("*") if f.suffix.lower() in SUFFIXES and f.is_file()
         and not any(p.startswith(".") for p in f.relative_to(root).parts)),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    if not files:
        raise DataError(f"no .jsonl, .json or .parquet files under {root}: set data.path to a file or a folder of them")
    return files


def _records(file: Path) -> Iterator[tuple[str, object]]:
    """(where, record) for every record of one file."""
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise DataError(f"{file}: reading Parquet needs pyarrow: pip install pyarrow, or convert it to .jsonl") from err
        for i, row in enumerate(pq.read_table(file).to_pylist()):
            yield f"{file}:row {i + 1}", row
        return
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{file} is not UTF-8 text ({err.reason} at byte {err.start}): convert it") from err
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{file}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from err
        except RecursionError:
            raise DataError(f"{file}: JSON nested deeper than Python reads (~1,000 levels): not a chat record; fix the file") from None
        for i, item in enumerate(items):
            yield f"{file}:item {i + 1}", item
        return
    for n, line in enumerate(text.splitlines(), start=1):  # JSON Lines (a .json file of objects, one a line, too)
        if not line.strip():
            continue
        try:
            yield f"{file}:{n}", json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{file}:{n}: not valid JSON ({err.msg}, column {err.colno}): fix or remove the line") from err
        except RecursionError:
            raise DataError(f"{file}:{n}: JSON nested deeper than Python reads (~1,000 levels): not a chat record; fix or remove the line") from None


def _text(record: dict, key: str, where: str, required: bool = True) -> str:
    value = record.get(key)
    if value is None:
        if required:
            raise DataError(f"{where}: field '{key}' is missing or null")
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    return value


def _messages(value, where: str, field: str) -> list[dict]:
    """role/content messages; an assistant turn may carry tool_calls instead of content, a tool turn answers one."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{field}' must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for i, m in enumerate(value):
        at = f"{where}: field '{field}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at}' must be an object with 'role' and 'content'")
        if not isinstance(m.get("role"), str):
            raise DataError(f"{at}.role' is missing" if "role" not in m else f"{at}.role' must be a string, got {type(m['role']).__name__}")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls)):
            raise DataError(f"{at}.tool_calls' must be a list of {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}} "
                            f"objects on an assistant turn")
        if "content" not in m and not calls:
            raise DataError(f"{at}.content' is missing")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and calls):
            raise DataError(f"{at}.content' must be a string, got {type(content).__name__}")
        out.append(dict(m))  # content stays None where it is: the template sees what apply_chat_template passes
    return out


def _is_call(call) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _sharegpt(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list of {{\"from\", \"value\"}} objects")
    out = []
    for i, turn in enumerate(value):
        at = f"{where}: field 'conversations[{i}]"
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(f"{at}' must be an object with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise DataError(f"{at}.from' is {turn['from']!r}: expected one of {', '.join(SHAREGPT_ROLES)}")
        if not isinstance(turn["value"], str):
            raise DataError(f"{at}.value' must be a string, got {type(turn['value']).__name__}")
        out.append({"role": role, "content": turn["value"]})
    return out


def _tools(record: dict, where: str) -> Optional[list]:
    tools = record.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):  # some exports store the schemas as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: field 'tools' is a string but not JSON ({err.msg})") from err
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: field 'tools' must be a list of function schemas (objects)")
    return tools


def detect(record: dict, where: str) -> str:
    for name, keys in KEYS.items():
        if all(k in record for k in keys):
            return name
    raise DataError(
        f"{where}: no known format (keys {sorted(record)[:8]}): expected 'messages', 'conversations' (ShareGPT), "
        f"'prompt'+'completion' or 'instruction'+'output'; or set data.format"
    )


def to_messages(record: object, fmt: str, where: str) -> list[dict]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    fmt = detect(record, where) if fmt == "auto" else fmt
    if fmt == "messages":
        return _messages(record.get("messages"), where, "messages")
    if fmt == "sharegpt":
        return _sharegpt(record.get("conversations"), where)
    if fmt == "prompt_completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            return _messages(prompt, where, "prompt") + _messages(completion, where, "completion")
        return [{"role": "user", "content": _text(record, "prompt", where)},
                {"role": "assistant", "content": _text(record, "completion", where)}]
    instruction, extra = _text(record, "instruction", where), _text(record, "input", where, required=False)
    return [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction},
            {"role": "assistant", "content": _text(record, "output", where)}]


def read_conversations(path: str | Path, fmt: str = "auto") -> Iterator[Conversation]:
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt} is not a chat format: choose {'|'.join(FORMATS)}")
    for file in chat_files(path):
        for where, record in _records(file):
            messages = to_messages(record, fmt, where)
            yield Conversation(messages, where, _tools(record, where) if isinstance(record, dict) else None)

"""Chat and instruction records from JSON Lines, JSON arrays or Parquet, as lists of messages.

Formats (data.format; `auto` tells them apart by their keys, record by record):
  messages           {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
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
from typing import Iterator

from .errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")
FORMATS = ("auto", "messages", "prompt_completion", "alpaca")
KEYS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "alpaca": ("instruction", "output")}


@dataclass
class Conversation:
    messages: list[dict]
    where: str  # "file:line", for messages about this record


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
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{field}' must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: field '{field}[{i}]' must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: field '{field}[{i}].{key}' is missing")
            if not isinstance(m[key], str):
                raise DataError(f"{where}: field '{field}[{i}].{key}' must be a string, got {type(m[key]).__name__}")
        out.append(dict(m))
    return out


def detect(record: dict, where: str) -> str:
    for name, keys in KEYS.items():
        if all(k in record for k in keys):
            return name
    raise DataError(
        f"{where}: no known format (keys {sorted(record)[:8]}): expected 'messages', 'prompt'+'completion' or "
        f"'instruction'+'output'; or set data.format"
    )


def to_messages(record: object, fmt: str, where: str) -> list[dict]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    fmt = detect(record, where) if fmt == "auto" else fmt
    if fmt == "messages":
        return _messages(record.get("messages"), where, "messages")
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
            yield Conversation(to_messages(record, fmt, where), where)

"""The chat template a run trained with, written into an exported model's tokenizer files.

transformers reads a tokenizer's template from tokenizer_config.json (`chat_template`) or from
chat_template.jinja beside it. A run whose tokenizer had none trained through the ChatML fallback (or
through data.chat_template): the exported folder must carry that template, or `apply_chat_template`
on it raises, or renders another layout than the one the model learnt.
"""
from __future__ import annotations

import json
from pathlib import Path

from rptrain.data.chat_template import ChatTemplate


def write_chat_template(folder: Path, template: ChatTemplate) -> None:
    """Set `template` as the folder's chat template, in every place transformers reads one from."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    config["chat_template"] = template.source  # a list of named templates becomes the one trained
    tmp = config_file.with_name(f".{config_file.name}.tmp")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(config_file)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():  # copied from the source folder: it must not say something else
        jinja.write_text(template.source, encoding="utf-8")


def template_line(template: ChatTemplate, tokenizer: object) -> str:
    """The start-up line saying which template renders the conversations, and why."""
    name = template.name
    if name.startswith("chatml (the tokenizer has no"):
        where = getattr(tokenizer, "path", None)
        owner = where.parent if where is not None else "the byte tokenizer"
        return (f">>> chat template: ChatML, because {owner} has no chat_template (tokenizer_config.json or chat_template.jinja); "
                f"the exported hf/ carries it. data.chat_template=FILE.jinja chooses another")
    if name.startswith("chatml (data.chat_template"):
        return ">>> chat template: ChatML (data.chat_template=chatml); the exported hf/ carries it"
    why = "data.chat_template" if name.endswith(".jinja") else "the tokenizer's own"
    return f">>> chat template: {name} ({why}); the exported hf/ carries it"

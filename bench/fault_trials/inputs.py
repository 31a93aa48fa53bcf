"""Hostile inputs a run reads: broken Hugging Face folders, broken data files and chat-template payloads.
Each run completes, or refuses with one line; a case marked ``must_refuse`` completing is a failure
(it trained on something wrong), and no input may run code or print a traceback."""
from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Callable

from rptrain.cli.main import main as rptrain_main

from . import outcome as o
from .inprocess import call, judged
from .proc import ROOT

TINY_LM = ["model.dim=16", "model.n_heads=2", "model.n_kv_heads=1", "trainer.batch_size=2", "trainer.max_steps=1",
           "precision=fp32", "trainer.hf_export=false"]
HF_DATA = ["data=synthetic_tokens", "data.vocab_size=64", "data.num_train=8", "data.num_val=4", "data.seq_len=16",
           "trainer.batch_size=2", "trainer.max_steps=1", "precision=fp32", "trainer.hf_export=false"]


def make_hf_folder(work: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_fixture import llama_folder

    return llama_folder(work / "hf-base")


# --------------------------------------------------------------------------- Hugging Face folders
def _config(folder: Path, change: Callable[[dict], object]) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    replaced = change(config)
    path.write_text(json.dumps(config if replaced is None else replaced))


def _weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def _tensors(folder: Path, change: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(_weights(folder))
    change(tensors)
    save_file(tensors, _weights(folder), metadata={"format": "pt"})


def _remote_code(folder: Path, marker: Path) -> None:
    (folder / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n")
    _config(folder, lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_evil.Evil", "AutoConfig": "modeling_evil.Cfg"}))


def _first(tensors: dict) -> str:
    return next(k for k in sorted(tensors) if k.endswith("q_proj.weight"))


HF_CASES: dict[str, tuple[Callable[[Path, Path], None], bool]] = {  # name: (damage, must_refuse)
    "config_not_json": (lambda f, m: (f / "config.json").write_text('{"model_type": "llama", "hidden_'), True),
    "config_is_a_list": (lambda f, m: _config(f, lambda c: [c]), True),
    "config_missing": (lambda f, m: (f / "config.json").unlink(), True),
    "hidden_size_float": (lambda f, m: _config(f, lambda c: c.update(hidden_size=32.5)), True),
    "hidden_size_string": (lambda f, m: _config(f, lambda c: c.update(hidden_size="32")), True),
    "negative_layers": (lambda f, m: _config(f, lambda c: c.update(num_hidden_layers=-1)), True),
    "layers_huge": (lambda f, m: _config(f, lambda c: c.update(num_hidden_layers=10**9)), True),
    "rope_scaling_string": (lambda f, m: _config(f, lambda c: c.update(rope_scaling="linear")), True),
    "rope_both_kinds": (lambda f, m: _config(f, lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                                                  rope_scaling={"rope_type": "linear", "factor": 2.0})), False),
    "unknown_model_type": (lambda f, m: _config(f, lambda c: c.update(model_type="evil_arch", architectures=["EvilForCausalLM"])), True),
    "remote_code": (_remote_code, False),
    "weights_truncated": (lambda f, m: _weights(f).write_bytes(_weights(f).read_bytes()[: _weights(f).stat().st_size // 2]), True),
    "weights_header_garbage": (lambda f, m: _weights(f).write_bytes(b"\xff" * 8 + _weights(f).read_bytes()[8:]), True),
    "weights_missing": (lambda f, m: _weights(f).unlink(), True),
    "weight_wrong_shape": (lambda f, m: _tensors(f, lambda t: t.__setitem__(_first(t), t[_first(t)][:, :-1].contiguous())), True),
    "weight_int32": (lambda f, m: _tensors(f, lambda t: t.__setitem__(_first(t), t[_first(t)].to(__import__("torch").int32))), True),
    "weight_nan": (lambda f, m: _tensors(f, lambda t: t[_first(t)].fill_(float("nan"))), True),
    "index_to_missing_shard": (lambda f, m: ((f / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}})), _weights(f).unlink()), True),
    "pickle_weights": (lambda f, m: (_weights(f).unlink(), __import__("torch").save({"x": _Evil(m)}, f / "pytorch_model.bin")), True),
    "tokenizer_garbage": (lambda f, m: (f / "tokenizer.json").write_text("{not json"), True),
    "tokenizer_config_list": (lambda f, m: (f / "tokenizer_config.json").write_text("[1, 2]"), True),
    "weights_symlink_elsewhere": (lambda f, m: (_weights(f).unlink(), _weights(f).symlink_to("/etc/hostname")), True),
}


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def hf_trial(index: int, work: Path, base: Path, markers: Path, rng: random.Random) -> o.Trial:
    name = sorted(HF_CASES)[index % len(HF_CASES)]
    damage, must_refuse = HF_CASES[name]
    folder = work / f"hf-{index}"
    shutil.copytree(base, folder)
    damage(folder, markers / f"pwned-hf-{index}")
    data = HF_DATA
    if name.startswith("tokenizer"):  # synthetic tokens never read the tokenizer: a text corpus through it does
        (work / "corpus.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
        data = ["data=text", f"data.path={work / 'corpus.txt'}", "data.seq_len=16", *HF_DATA[5:]]
    code, out, err = call(rptrain_main, ["model=hf", f"model.path={folder}", *data, f"hydra.run.dir={folder}-run"], work)
    trial = judged("hf_folder", name, code, err, markers, must_refuse, {})
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(f"{folder}-run", ignore_errors=True)
    return trial


# --------------------------------------------------------------------------- data files
def _chat(*records: object) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n"


OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
DATA_CASES: dict[str, tuple[str, Callable[[random.Random], bytes], bool]] = {  # name: (data group, bytes, must_refuse)
    "text_random_bytes": ("text", lambda r: bytes(r.randrange(256) for _ in range(4096)), False),
    "text_empty": ("text", lambda r: b"", True),
    "text_nul_bytes": ("text", lambda r: b"\0" * 4096, False),
    "text_one_long_line": ("text", lambda r: b"ab" * 2_000_000, False),
    "text_invalid_utf8": ("text", lambda r: b"hello \xc3\x28 world \xff\xfe" * 200, False),
    "chat_nested_deep": ("chat", lambda r: ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n").encode(), True),
    "chat_lone_surrogate": ("chat", lambda r: _chat({"messages": [{"role": "user", "content": "hi \ud800"},
                                                                  {"role": "assistant", "content": "ok"}]}).encode("utf-8", "surrogatepass"), True),
    "chat_escaped_surrogate": ("chat", lambda r: _chat('{"messages": [{"role": "user", "content": "hi \\ud800"}, '
                                                       '{"role": "assistant", "content": "ok"}]}').encode(), True),
    "chat_empty": ("chat", lambda r: b"", True),
    "chat_not_json": ("chat", lambda r: b"{this is not json\n", True),
    "chat_record_a_list": ("chat", lambda r: _chat([1, 2, 3]).encode(), True),
    "chat_content_a_number": ("chat", lambda r: _chat({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": 7}]}).encode(), True),
    "chat_unknown_role": ("chat", lambda r: _chat({"messages": [{"role": "root", "content": "hi"}, {"role": "assistant", "content": "x"}]}).encode(), False),  # roles are the template's to name (tool, developer, ipython)
    "chat_no_messages": ("chat", lambda r: _chat({"nothing": 1}).encode(), True),
    "chat_huge_number": ("chat", lambda r: _chat('{"messages": [{"role": "user", "content": "hi"}], "n": ' + "9" * 100_000 + "}").encode(), True),
    "chat_mixed_good_and_bad": ("chat", lambda r: _chat(OK, "{broken", OK).encode(), True),
    "chat_binary": ("chat", lambda r: bytes(r.randrange(256) for _ in range(4096)), True),
}


def data_trial(index: int, work: Path, markers: Path, rng: random.Random) -> o.Trial:
    name = sorted(DATA_CASES)[index % len(DATA_CASES)]
    group, content, must_refuse = DATA_CASES[name]
    folder = work / f"data-{index}"
    folder.mkdir()
    path = folder / ("corpus.txt" if group == "text" else "chat.jsonl")
    path.write_bytes(content(rng))
    args = ["model=llama_tiny", *TINY_LM, f"data={group}", f"data.path={path}", "data.tokenizer=byte", f"hydra.run.dir={folder / 'run'}"]
    args += ["data.seq_len=16"] if group == "text" else ["data.max_seq_len=64"]
    code, out, err = call(rptrain_main, args, folder)
    trial = judged("data_file", name, code, err, markers, must_refuse, {})
    shutil.rmtree(folder, ignore_errors=True)
    return trial


# --------------------------------------------------------------------------- chat templates
def _templates(marker: Path) -> dict[str, str]:
    touch = f"touch {marker}"
    return {
        "mro_subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "cycler_globals_os": "{{ cycler.__init__.__globals__.os.popen('" + touch + "').read() }}",
        "joiner_globals": "{{ joiner.__init__.__globals__['os'].system('" + touch + "') }}",
        "lipsum_globals": "{{ lipsum.__globals__['os'].system('" + touch + "') }}",
        "namespace_class": "{% set n = namespace() %}{{ n.__class__.__init__.__globals__ }}",
        "format_attribute": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
        "range_huge": "{% for i in range(10**9) %}x{% endfor %}",
        "string_huge": "{{ 'x' * 10**9 }}",
        "nested_loops": "{% for i in range(99999) %}{% for j in range(99999) %}{{ 'abcdefgh' * 100 }}{% endfor %}{% endfor %}",
        "recursive_macro": "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
        "division_by_zero": "{{ 1 / 0 }}",
        "include_file": "{% include '/etc/passwd' %}",
        "raise_exception": "{{ raise_exception('boom') }}",
        "pow_huge": "{{ 10 ** 10 ** 10 }}",
        "undefined_call": "{{ nothing() }}",
        "self_globals": "{{ self.__init__.__globals__ }}",
    }


def template_trial(index: int, work: Path, markers: Path, rng: random.Random) -> o.Trial:
    marker = markers / f"pwned-template-{index}"
    templates = _templates(marker)
    name = sorted(templates)[index % len(templates)]
    folder = work / f"template-{index}"
    folder.mkdir()
    (folder / "t.jinja").write_text(templates[name])
    (folder / "chat.jsonl").write_text(_chat(OK, OK, OK, OK))
    args = ["model=llama_tiny", *TINY_LM, "data=chat", f"data.path={folder / 'chat.jsonl'}", "data.tokenizer=byte",
            f"data.chat_template={folder / 't.jinja'}", "data.max_seq_len=64", f"hydra.run.dir={folder / 'run'}"]
    code, out, err = call(rptrain_main, args, folder)
    trial = judged("template", name, code, err, markers, False, {})
    shutil.rmtree(folder, ignore_errors=True)
    return trial

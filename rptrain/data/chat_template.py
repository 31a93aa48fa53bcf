"""Chat templates: the tokenizer's own Jinja template, rendered as transformers renders it.

A Hugging Face model folder keeps its template in tokenizer_config.json (`chat_template`: a string,
or a list of named templates of which "default" is used) or in chat_template.jinja. Rendering
follows transformers' `apply_chat_template`: a sandboxed Jinja environment with trim_blocks and
lstrip_blocks, `raise_exception`, a `tojson` that keeps non-ASCII text, `strftime_now`, the
`{% generation %}` tag, and the tokenizer's special tokens (bos_token, eos_token, ...) as variables.

A template is data from a file, so rendering one is bounded: Jinja's sandbox (no attribute access to
Python internals, range() at most 100,000), plus string/list repetition and powers that would make
more than MAX_RENDERED_CHARS, at most MAX_RENDERED_CHARS of output, and RENDER_SECONDS of time per
conversation (in the main thread, where a timer can interrupt it). Whatever goes wrong inside a
template is one DataError naming the template.

A tokenizer without a template gets CHATML, the documented default:

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n...<|im_end|>\\n
"""
from __future__ import annotations

import contextlib
import json
import signal
import threading
from datetime import datetime
from pathlib import Path
from typing import Iterator, Optional

from .errors import DataError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_END = "<|im_end|>"  # where a ChatML assistant turn ends; generation stops there

# Far beyond any real conversation (the longest contexts are ~10^6 tokens): only a runaway template gets near.
MAX_RENDERED_CHARS = 64 * 2**20
RENDER_SECONDS = 30.0  # one conversation; real templates take well under a millisecond

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> Optional[str]:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(config: Optional[Path]) -> dict:
    if config is None:
        return {}
    try:
        return json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"could not read {config} ({type(err).__name__}: {err}): fix or remove the file") from err


def _template_of(config: dict, folder: Optional[Path]) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and folder is not None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template


class ChatTemplate:
    """render(messages) -> (text, generation spans): what apply_chat_template(tokenize=False) returns."""

    def __init__(self, source: str, special_tokens: Optional[dict[str, str]] = None, name: str = "") -> None:
        self.source, self.name = source, name
        self.special_tokens = dict(special_tokens or {})
        self.template = _compile(source, name)

    @classmethod
    def for_tokenizer(cls, config: Optional[Path], override: Optional[str] = None) -> "ChatTemplate":
        """The template of a tokenizer folder; `override` (data.chat_template) is 'chatml' or a .jinja file."""
        values = read_tokenizer_config(config)
        special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(values.get(k))) is not None}
        if override == "chatml":
            return cls(CHATML, special, "chatml (data.chat_template)")
        if override is not None:
            path = Path(override).expanduser()
            if not path.is_file():
                raise DataError(f"data.chat_template={override}: no such file: give a .jinja file, chatml, or null for the tokenizer's own")
            return cls(path.read_text(encoding="utf-8"), special, str(path))
        template = _template_of(values, config.parent if config else None)
        if template is None:
            return cls(CHATML, special, "chatml (the tokenizer has no chat_template)")
        return cls(template, special, f"{config}")

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: Optional[list] = None) -> tuple[str, list[tuple[int, int]]]:
        """`tools`: function schemas, the template's `tools` (None when there are none, as transformers passes it)."""
        import jinja2

        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        variables = {**self.special_tokens, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        size = 0
        try:
            with self.template.environment.tracking(blocks, spans), _time_limit(RENDER_SECONDS):
                for block in self.template.generate(**variables):
                    blocks.append(block)
                    size += len(block)
                    if size > MAX_RENDERED_CHARS:
                        raise _TooBig(f"it rendered more than {MAX_RENDERED_CHARS:,} characters for one conversation")
        except (jinja2.TemplateError, _TooBig, _TooSlow, ArithmeticError, RecursionError, MemoryError, TypeError, ValueError,
                LookupError, AttributeError) as err:
            what = " ".join(str(err).split())[:300] or type(err).__name__
            raise DataError(f"chat template {self.name} failed on a conversation ({type(err).__name__}: {what}): "
                            f"fix the template or set data.chat_template=chatml") from err
        return "".join(blocks), spans

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name})"


class _TooBig(Exception):
    pass


class _TooSlow(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """A _TooSlow raised in the block after `seconds` (main thread only: elsewhere no bound, as no timer can interrupt it)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None):
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise _TooSlow(f"it ran longer than {seconds:g} s on one conversation")

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _bounded_binop(operator: str, left: object, right: object) -> object:
    """`*` and `**` of a template, refused before they would build something huge."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_RENDERED_CHARS:
                raise _TooBig(f"{len(seq)} x {n} items is more than a chat template may build")
        return left * right
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > 2**16:
        raise _TooBig(f"{left} ** {right} is a larger number than a chat template may compute")
    return left ** right


def _compile(source: str, name: str):
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:
        raise DataError("chat data needs the 'jinja2' package to render chat templates: pip install jinja2") from err

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; record where each block lands."""

        tags = {"generation"}

        def __init__(self, environment) -> None:
            super().__init__(environment)
            environment.extend(tracking=self.tracking)
            self.state: Optional[tuple[list, list]] = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            if self.state is not None:
                blocks, spans = self.state
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

        def tracking(self, blocks: list, spans: list):
            extension = self

            class _Track:
                def __enter__(self):
                    extension.state = (blocks, spans)

                def __exit__(self, *exc):
                    extension.state = None

            return _Track()

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            return _bounded_binop(operator, left, right) if operator in ("*", "**") else super().call_binop(context, operator, left, right)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise DataError(f"chat template {name} is not valid Jinja (line {err.lineno}: {err.message}): fix it or set data.chat_template=chatml") from err

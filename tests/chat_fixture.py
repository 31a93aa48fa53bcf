"""Chat templates and conversations for the tests, and hf_fixture's tiny tokenizer folder carrying a template.

transformers' AutoTokenizer loads the folder, so `apply_chat_template` is the reference. Every template
carries `{% generation %}` blocks around what the assistant writes: transformers' `return_assistant_tokens_mask` then gives the reference loss mask; `untagged` strips the blocks to
exercise the prefix-rendering path that templates without them take.
"""
from __future__ import annotations

import re
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 3's layout, written over several lines so that trim_blocks, lstrip_blocks and {%- matter.
LLAMA3 = """{{ bos_token }}
{%- for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['role'] == 'assistant' %}
        {% generation %}
{{ message['content'] | trim + '<|eot_id|>' }}
        {%- endgeneration %}
    {% else %}
{{ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

# Like Qwen3: only the final assistant turn carries an (empty) thinking block, so an earlier turn
# renders differently once later turns follow it (the template is not prefix-stable).
THINKING = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

def untagged(template: str) -> str:
    """The template without generation blocks: each tag becomes an if-true block, which renders the same whitespace."""
    template = re.sub(r"{%(-?)\s*generation\s*(-?)%}", r"{%\1 if true \2%}", template)
    return re.sub(r"{%(-?)\s*endgeneration\s*(-?)%}", r"{%\1 endif \2%}", template)


def make_tokenizer_dir(folder: Path, template: str | None = CHATML) -> Path:
    """hf_fixture's tokenizer folder with this chat template; bos_token is named in tokenizer_config.json
    (templates write it themselves, as Llama 3's does)."""
    from hf_fixture import tokenizer_folder

    return tokenizer_folder(folder, bos="config", config={"chat_template": template} if template is not None else None)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "1 + 1 ="}, {"role": "assistant", "content": " 2"},
     {"role": "user", "content": "and 2 + 2?"}, {"role": "assistant", "content": "4, héllo"}],
    [{"role": "user", "content": "Translate to German: good morning."},
     {"role": "assistant", "content": "Guten Morgen."}, {"role": "user", "content": "thanks"}],
]

"""A tiny Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json with a chat template), built in the test.

Byte-level BPE trained on a few sentences, with ChatML's and Llama 3's control tokens as special
tokens, so transformers' AutoTokenizer loads it and `apply_chat_template` can be the reference.
Every template carries `{% generation %}` blocks around what the assistant writes: transformers'
`return_assistant_tokens_mask` then gives the reference loss mask; `untagged` strips the blocks to
exercise the prefix-rendering path that templates without them take.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

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

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris.",
    "You are a helpful assistant.", "Translate to German: good morning. Guten Morgen.",
    "system user assistant instruction input output", "1 + 1 = 2, 2 + 2 = 4, héllo wörld",
]


def untagged(template: str) -> str:
    """The template without generation blocks: each tag becomes an if-true block, which renders the same whitespace."""
    template = re.sub(r"{%(-?)\s*generation\s*(-?)%}", r"{%\1 if true \2%}", template)
    return re.sub(r"{%(-?)\s*endgeneration\s*(-?)%}", r"{%\1 endif \2%}", template)


def make_tokenizer_dir(folder: Path, template: str | None = CHATML, bos: str = "<|begin_of_text|>",
                       eos: str = "<|endoftext|>") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "1 + 1 ="}, {"role": "assistant", "content": " 2"},
     {"role": "user", "content": "and 2 + 2?"}, {"role": "assistant", "content": "4, héllo"}],
    [{"role": "user", "content": "Translate to German: good morning."},
     {"role": "assistant", "content": "Guten Morgen."}, {"role": "user", "content": "thanks"}],
]

"""Samples people read: the model's answers to trainer.sample_prompts after every evaluation.

Chat data renders each prompt as one user turn with the generation prompt, so the model answers as
it was trained to; text data continues the prompt, framed as the corpus's documents were. Generation stops at the tokenizer's EOS,
at an end-of-turn token, or at an end-of-turn string (a byte tokenizer spells <|im_end|> out); the
answers are printed and appended to samples.jsonl in the run directory, one line per prompt.

Which copy of the model generates: the engine's host model on a CPU run; on a GPU run a copy on
one GPU when it fits next to what the engine holds (KV cache); otherwise the engine itself,
recomputing the prefix at every token (layers stream through the pipeline as in training).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, ListConfig

from rptrain import RoundPipe, RoundPipeRunConfig
from rptrain.data import DataError
from rptrain.data.chat_template import CHATML_END, ChatTemplate
from rptrain.models.generate import generate

END_OF_TURN = (CHATML_END, "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def load_prompts(spec: Any) -> list[str]:
    """trainer.sample_prompts: None, a list of prompts, or a text file with one prompt a line."""
    if spec is None:
        return []
    if isinstance(spec, (list, tuple, ListConfig)):
        return [str(p) for p in spec]
    path = Path(str(spec)).expanduser()
    if not path.is_file():
        raise DataError(f"trainer.sample_prompts={spec}: no such file: give a list ([\"Hi\",\"2+2=\"]) or a text file, one prompt a line")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class Sampler:
    def __init__(self, tokenizer, template: Optional[ChatTemplate], prompts: list[str], max_tokens: int = 64,
                 temperature: float = 0.0, seed: int = 0, max_seq_len: Optional[int] = None) -> None:
        self.tokenizer, self.template, self.prompts = tokenizer, template, prompts
        self.max_tokens, self.temperature, self.seed, self.max_seq_len = max_tokens, temperature, seed, max_seq_len
        ids = [tokenizer.eos_id] + [getattr(tokenizer, "token_id", lambda t: None)(t) for t in END_OF_TURN]
        self.stop_ids = {i for i in ids if i is not None}

    def encode(self, prompt: str) -> list[int]:
        if self.template is None:  # framed as training framed documents (BOS, when the tokenizer adds one), open-ended
            ids = self.tokenizer.document(prompt)
            return ids[:-1] if ids[-1:] == [self.tokenizer.eos_id] else ids
        text, _ = self.template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def _stop(self, ids: list[int]) -> bool:
        return ids[-1] in self.stop_ids or any(s in self.tokenizer.decode(ids) for s in END_OF_TURN)

    def answer(self, model, prompt: str, device: torch.device | str = "cpu") -> str:
        generator = torch.Generator().manual_seed(self.seed)
        ids = generate(model, self.encode(prompt), self.max_tokens, self._stop, self.temperature, generator, self.max_seq_len, device)
        text = self.tokenizer.decode(ids)
        for s in END_OF_TURN:
            text = text.split(s)[0]
        return text

    def run(self, model, step: int, device: torch.device | str = "cpu") -> list[dict]:
        return [{"step": step, "prompt": p, "completion": self.answer(model, p, device)} for p in self.prompts]


def make_sampler(cfg: DictConfig, data) -> Optional[Sampler]:
    t = cfg.trainer
    prompts = load_prompts(t.get("sample_prompts"))
    if not prompts or data.tokenizer is None:
        return None
    return Sampler(data.tokenizer, data.template, prompts, t.sample_max_tokens, t.sample_temperature, t.seed,
                   cfg.model.get("max_seq_len"))


def _fits_one_gpu(model: torch.nn.Module) -> bool:
    if not torch.cuda.is_available():
        return False
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info()
    return 2 * size < free  # weights, plus room for the cache and activations


def write_samples(engine: RoundPipe, sampler: Sampler, step: int, run_dir: Path, say) -> None:
    """After engine.synchronize(), in eval mode: generate, print and append to run_dir/samples.jsonl."""
    host = engine.model
    if not engine.keeps_user_weights and torch.cuda.is_available():  # the module holds placeholders: the engine generates
        one = RoundPipeRunConfig(num_microbatch=1)
        records = sampler.run(lambda ids: engine(ids, run_config=one), step)
    elif not torch.cuda.is_available():
        records = sampler.run(host, step)
    elif _fits_one_gpu(host):
        records = sampler.run(copy.deepcopy(host).to("cuda"), step, "cuda")
        torch.cuda.empty_cache()
    else:
        one = RoundPipeRunConfig(num_microbatch=1)
        records = sampler.run(lambda ids: engine(ids, run_config=one), step)
    with open(run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            say(f"sample @ step {step}: {r['prompt']!r} -> {r['completion']!r}")

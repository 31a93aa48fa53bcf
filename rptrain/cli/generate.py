"""`rptrain-generate PATH PROMPT [PROMPT ...]`: a trained model's answers, one per prompt.

PATH is a run directory (its checkpoints/last.pt), a checkpoint file, a Hugging Face folder
(config.json + safetensors + tokenizer files, e.g. a run's hf/), or a LoRA adapter folder (a run's
adapter/: PEFT's adapter_config.json + adapter_model.safetensors) whose adapters are folded into its
base model (--base, default the adapter_config.json's base_model_name_or_path). A run rebuilds its model and
tokenizer from the config it was written with; a chat run (and any folder with a chat template)
renders each prompt as a user turn, `--raw` continues the text as it is. Greedy by default; the
model runs on one device with a KV cache (--device auto: a GPU when there is one).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Optional

import torch
from omegaconf import open_dict

from rptrain.data import load_tokenizer
from rptrain.data.chat_template import ChatTemplate
from rptrain.models.lora import fold
from rptrain.train.checkpoint import load_checkpoint
from rptrain.train.data import _chat_tokenizer
from rptrain.train.errors import USER_ERRORS, ConfigError, one_line
from rptrain.train.export import EMBEDDING
from rptrain.train.model import build_model
from rptrain.train.run_weights import check_same_model, run_checkpoint, run_config
from rptrain.train.samples import Sampler
from rptrain.train.tokenizer import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fail(message: str) -> NoReturn:
    print(f"rptrain-generate: error: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rptrain-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", metavar="PATH", help="a run directory, a checkpoint file or a Hugging Face folder")
    parser.add_argument("prompts", metavar="PROMPT", nargs="+")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per answer (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw", action="store_true", help="no chat template: continue each prompt as plain text")
    parser.add_argument("--base", default=None, help="an adapter's base model folder (default: its adapter_config.json's)")
    parser.add_argument("--device", default="auto", help="auto (default) | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.error = lambda message: _fail(f"{message}: see rptrain-generate --help")  # type: ignore[method-assign]
    return parser


def _from_run(checkpoint: Path, dtype: torch.dtype):
    state = load_checkpoint(checkpoint)
    cfg = run_config(checkpoint, state)
    weights = state["model"]
    if EMBEDDING not in weights:
        raise ConfigError(f"{checkpoint} is a model={cfg.model.name} run: only language models generate text")
    with open_dict(cfg):
        cfg.model.weights = None  # the checkpoint holds the weights
    model = build_model(cfg, dtype, device="meta", vocab_size=int(weights[EMBEDDING].shape[0]))
    check_same_model(model, weights, f"checkpoint {checkpoint}")
    model = model.to_empty(device="cpu")
    model.load_state_dict(weights)
    if cfg.data.name == "chat":
        return model, *_chat_tokenizer(cfg)
    if cfg.data.name != "text":
        raise ConfigError(f"{checkpoint} trained on data={cfg.data.name}, which has no tokenizer to write text with")
    return model, build_tokenizer(cfg), None


def _from_folder(folder: Path, dtype: torch.dtype):
    from hydra import compose, initialize_config_module

    from rptrain.train.schema import register_configs

    register_configs()
    try:
        with initialize_config_module("rptrain.conf", version_base="1.3"):
            cfg = compose("config", overrides=["model=hf", f"model.path={folder}"])
    except Exception as err:  # Hydra's own errors: no model=hf option in this install, a bad path
        raise ConfigError(f"{folder} could not be read as model=hf ({one_line(err)[:200]})") from err
    model = build_model(cfg, dtype)
    config = folder / "tokenizer_config.json"
    return model, load_tokenizer(folder), ChatTemplate.for_tokenizer(config if config.is_file() else None)


def _from_adapter(adapter: Path, base: Optional[str], dtype: torch.dtype):
    """The base folder's model with the adapter's B @ A x alpha / r folded into each adapted weight."""
    import json

    from safetensors.torch import load_file

    from rptrain.models.hf_names import seq_name
    from rptrain.models.lora_export import PEFT_PREFIX

    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    base = base or config.get("base_model_name_or_path")
    if not base or not (Path(base).expanduser() / "config.json").is_file():
        raise ConfigError(f"{adapter}: its base model {base!r} is not a Hugging Face folder (config.json) here: give it with --base DIR")
    model, tokenizer, template = _from_folder(Path(base).expanduser(), dtype)
    if (adapter / "chat_template.jinja").is_file():  # the template the adapters were trained with
        template = ChatTemplate((adapter / "chat_template.jinja").read_text(encoding="utf-8"), template.special_tokens, str(adapter / "chat_template.jinja"))
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    scaling = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    weights, state = load_file(str(adapter / "adapter_model.safetensors")), model.state_dict()
    with torch.no_grad():
        for key, lora_a in weights.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
            target = seq_name(f"{module}.weight", len(model) - 2)
            if target not in state:
                raise ConfigError(f"{adapter}: {key} adapts {module}, which the base model {base} does not have: give its own base with --base")
            lora_b = weights[key.replace(".lora_A.", ".lora_B.")]
            state[target].copy_(fold(state[target], lora_a, lora_b, scaling))
    return model, tokenizer, template


def load_for_generation(path: str, dtype: torch.dtype, base: Optional[str] = None):
    """(model on the CPU, tokenizer, chat template or None) of a run directory, checkpoint, HF or adapter folder."""
    source = Path(path).expanduser()
    checkpoint = run_checkpoint(source)
    if checkpoint is not None:
        return _from_run(checkpoint, dtype)
    if (source / "adapter_config.json").is_file():
        return _from_adapter(source, base, dtype)
    if (source / "config.json").is_file():
        return _from_folder(source, dtype)
    raise ConfigError(f"{path} is not a run directory (checkpoints/last.pt), an rptrain checkpoint, a Hugging Face folder (config.json) "
                      f"or a LoRA adapter folder (adapter_config.json)")


def main(argv: Optional[list[str]] = None) -> None:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        model, tokenizer, template = load_for_generation(args.path, dtype, args.base)
        model = model.to(device).eval()
        sampler = Sampler(tokenizer, None if args.raw else template, args.prompts, args.max_tokens, args.temperature, args.seed,
                          getattr(model[0], "max_seq_len", None))
        for prompt in args.prompts:
            print(sampler.answer(model, prompt, device), flush=True)
    except (*USER_ERRORS, OSError) as err:
        _fail(str(err))


if __name__ == "__main__":
    main()

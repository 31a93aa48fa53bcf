"""A Hugging Face checkpoint's config.json -> the DecoderConfig of the one decoder.

Every field of config.json is either read (it changes the math and rptrain does the same), or
known to be harmless (token ids, dtype, cache settings, ...), or refused with `HFModelError`:
one line naming the field, the family and what is supported. Nothing is silently ignored.
Defaults for absent fields are transformers' own for that family.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rptrain.models.decoder_config import DecoderConfig
from rptrain.models.rope import ROPE_TYPES, Rope


class HFModelError(ValueError):
    """config.json or the weights of a Hugging Face folder that rptrain cannot train exactly."""


# Fields that never change the forward or backward pass.
HARMLESS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
    "bos_token_id", "eos_token_id", "use_cache", "initializer_range", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "cache_implementation", "pretraining_tp", "_attn_implementation_autoset", "use_return_dict",
    "torchscript", "tie_encoder_decoder", "is_decoder", "add_cross_attention", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "tf_legacy_loss", "use_bfloat16",
    "max_length", "bad_words_ids", "num_beams", "do_sample", "temperature", "top_k", "top_p",
}
# Read by every family.
COMMON = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "hidden_act", "max_position_embeddings", "tie_word_embeddings", "attention_dropout",
    "rope_theta", "rope_scaling", "rope_parameters", "pad_token_id",
}
SLIDING = {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
GEMMA2 = {"attention_bias", "hidden_activation", "use_bidirectional_attention", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
          "sliding_window", "layer_types"}
FAMILIES: dict[str, set[str]] = {
    "llama": {"attention_bias", "mlp_bias", "max_sequence_length"},  # max_sequence_length: LLaMA-1 files; unused
    "mistral": {"sliding_window", "attention_bias"},  # attention_bias: must be false (no biases in transformers' Mistral)
    "qwen2": SLIDING,
    "qwen3": SLIDING | {"attention_bias"},
    "gemma": {"attention_bias", "hidden_activation", "use_bidirectional_attention"},
    "gemma2": GEMMA2 | {"sliding_window_size"},  # an old duplicate of sliding_window that transformers ignores
    "gemma3_text": GEMMA2 | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
    "phi3": {"sliding_window", "embd_pdrop", "resid_pdrop", "original_max_position_embeddings", "partial_rotary_factor",
             "attention_bias"},
}
GEMMAS = ("gemma", "gemma2", "gemma3_text")
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},  # transformers' dynamic reads max_position_embeddings
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


class _Fields:
    """config.json with a family name for messages."""

    def __init__(self, raw: dict[str, Any], family: str, where: str):
        self.raw, self.family, self.where = raw, family, where

    def fail(self, field: str, why: str) -> HFModelError:
        value = json.dumps(self.raw.get(field)) if field in self.raw else "(absent)"
        value = value if len(value) <= 80 else value[:77] + "..."  # long_factor lists: keep the line short
        return HFModelError(f"{self.where}: {field}={value} ({self.family}): {why}")

    def get(self, field: str, default: Any = None) -> Any:
        value = self.raw.get(field)
        return default if value is None else value

    def opt(self, field: str, default: Any) -> Any:
        """Like get, but an explicit null stays None (soft-capping, sliding_window)."""
        return self.raw[field] if field in self.raw else default

    def need(self, field: str) -> Any:
        if self.raw.get(field) is None:
            raise self.fail(field, "is required to build the model: the folder's config.json looks incomplete")
        return self.raw[field]

    def zero(self, field: str) -> None:
        if self.get(field, 0.0) != 0:
            raise self.fail(field, "dropout is not supported: set it to 0.0 in config.json")


def read_config_json(path: str | Path) -> dict[str, Any]:
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise HFModelError(f"model.path={path}: no config.json there: point model.path at a Hugging Face model folder")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise HFModelError(f"{file}: cannot be read as JSON ({err})") from None


def _rope(f: _Fields, params: dict[str, Any], label: str, max_positions: int) -> Rope:
    params = dict(params)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind not in ROPE_TYPES:
        raise f.fail(label, f"rope type {kind!r} is not supported: rptrain supports {', '.join(ROPE_TYPES)}")
    theta = params.pop("rope_theta", None)
    partial = params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise f.fail(label, f"{unknown[0]} is not a {kind} rope setting rptrain knows: it supports {', '.join(sorted(ROPE_KEYS[kind])) or 'none'}")
    original = params.get("original_max_position_embeddings") or f.get("original_max_position_embeddings", max_positions)
    kw: dict[str, Any] = dict(theta=float(theta), type=kind, max_position_embeddings=max_positions,
                              original_max_position_embeddings=int(original))
    if partial is not None:
        kw["partial_rotary_factor"] = float(partial)
    if kind != "default":
        factor = params.get("factor")
        if factor is None and kind == "yarn":  # transformers: the context extension ratio
            factor = max_positions / original
        if factor is None:
            raise f.fail(label, f"{kind} rope scaling needs a factor")
        kw["factor"] = float(factor)
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None and kind in ("llama3", "yarn"):
            kw[key] = float(params[key])
    if "truncate" in params:
        kw["truncate"] = bool(params["truncate"])
    try:
        return Rope(**kw)
    except ValueError as err:
        raise f.fail(label, str(err)) from None


def _ropes(f: _Fields, max_positions: int) -> tuple[Rope, Rope | None]:
    """(the rope of full-attention layers, the sliding layers' own or None)."""
    new = f.raw.get("rope_parameters")
    if f.family == "gemma3_text":
        if new is not None:
            full, local = new.get("full_attention", {}), new.get("sliding_attention", {})
        else:
            full, local = dict(f.get("rope_scaling", {})), {}
            local["rope_theta"] = f.get("rope_local_base_freq", 10000.0)
        full.setdefault("rope_theta", f.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", 10000.0)
        return _rope(f, full, "rope_parameters", max_positions), _rope(f, local, "rope_parameters", max_positions)
    label = "rope_parameters" if new is not None else "rope_scaling"
    params = dict(new if new is not None else f.get("rope_scaling", {}))
    params.setdefault("rope_theta", f.get("rope_theta", 10000.0))
    if f.raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", f.raw["partial_rotary_factor"])
    rope = _rope(f, params, label, max_positions)
    if rope.partial_rotary_factor != 1 and f.family != "phi3":
        raise f.fail(label, "partial_rotary_factor other than 1 is supported for phi3 only")
    return rope, None


def _sliding_layers(f: _Fields, n_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    window = f.opt("sliding_window", 4096 if f.family in ("mistral", "gemma2", "gemma3_text") else None)
    types = f.raw.get("layer_types")
    family = f.family
    if family in ("qwen2", "qwen3") and not f.get("use_sliding_window", False):
        window = None  # transformers drops the window unless use_sliding_window
    if types is None:
        if family in ("mistral", "phi3"):
            types = ["sliding_attention"] * n_layers
        elif family in ("qwen2", "qwen3"):
            first = f.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        elif family == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        elif family == "gemma3_text":
            pattern = f.get("sliding_window_pattern", f.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        else:
            types = ["full_attention"] * n_layers
    if len(types) != n_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise f.fail("layer_types", f"needs {n_layers} entries, each full_attention or sliding_attention")
    if window is None:
        return None, ()
    if int(window) < 1:
        raise f.fail("sliding_window", "must be a positive number of tokens or null")
    return int(window), tuple(t == "sliding_attention" for t in types)


def _activation(f: _Fields) -> str:
    if f.family in GEMMAS:
        # Gemma reads hidden_act ("gelu" meant the tanh approximation); Gemma-2/3 read hidden_activation.
        field = "hidden_act" if f.family == "gemma" else "hidden_activation"
        if f.get(field, "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu") or (f.family != "gemma" and f.get(field) == "gelu"):
            raise f.fail(field, "rptrain supports gelu_pytorch_tanh for this family")
        return "gelu_tanh"
    if f.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", "rptrain supports silu for this family")
    return "silu"


def decoder_config(raw: dict[str, Any], where: str = "config.json", max_seq_len: int | None = None,
                   loss_chunk_tokens: int = 4096, attention: str = "auto", fused: bool = False) -> DecoderConfig:
    """Raise HFModelError (one line) for anything rptrain would not compute as transformers does."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise HFModelError(f"{where}: model_type={json.dumps(family)} is not supported: rptrain trains {', '.join(FAMILIES)}")
    f = _Fields(raw, family, where)
    for arch in f.get("architectures", []):
        if not arch.endswith("ForCausalLM"):
            raise f.fail("architectures", "rptrain trains causal language models (*ForCausalLM) only")
    allowed = HARMLESS | COMMON | FAMILIES[family]
    for key in raw:
        if key not in allowed:
            raise f.fail(key, f"rptrain does not know this field, which may change the model's math; the {family} fields it reads: "
                              f"{', '.join(sorted(COMMON | FAMILIES[family]))}")
    for key in ("attention_dropout", "embd_pdrop", "resid_pdrop"):
        f.zero(key)
    if family in ("mistral", "phi3") and f.get("attention_bias", False):
        raise f.fail("attention_bias", f"transformers' {family} has no attention biases: it must be false")
    if f.get("use_bidirectional_attention", False):
        raise f.fail("use_bidirectional_attention", "rptrain trains causal decoders: it must be false")
    hidden, heads = int(f.need("hidden_size")), int(f.need("num_attention_heads"))
    n_layers = int(f.need("num_hidden_layers"))
    head_dim = int(f.get("head_dim", hidden // heads))
    max_positions = int(f.get("max_position_embeddings", 2048))
    rope, local_rope = _ropes(f, max_positions)
    window, sliding = _sliding_layers(f, n_layers)
    gemma2 = family in ("gemma2", "gemma3_text")
    activation = _activation(f)
    bias = bool(f.get("attention_bias", False))
    vocab = int(f.need("vocab_size"))
    pad = f.raw.get("pad_token_id")
    if pad is not None and not -vocab <= int(pad) < vocab:
        raise f.fail("pad_token_id", f"must be a token id below vocab_size={vocab} or null")
    pad = None if pad is None else int(pad) % vocab  # -1: the last row, as nn.Embedding reads it
    try:
        return DecoderConfig(
            vocab_size=vocab, hidden_size=hidden, n_layers=n_layers, n_heads=heads,
            n_kv_heads=int(f.get("num_key_value_heads", heads)), head_dim=head_dim,
            intermediate_size=int(f.need("intermediate_size")),
            norm_eps=float(f.get("rms_norm_eps", 1e-5 if family == "phi3" else 1e-6)),
            norm_offset=family in GEMMAS, activation=activation,
            qkv_bias=bias or family == "qwen2", o_bias=bias, mlp_bias=bool(f.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3_text"), fused_qkv=family == "phi3", fused_gate_up=family == "phi3",
            sandwich_norms=gemma2, embed_scale=math.sqrt(hidden) if family in GEMMAS else None,
            attn_scale=float(f.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma2 else None,
            attn_softcap=f.opt("attn_logit_softcapping", 50.0 if family == "gemma2" else None) if gemma2 else None,
            final_softcap=f.opt("final_logit_softcapping", 30.0 if family == "gemma2" else None) if gemma2 else None,
            rope=rope, local_rope=local_rope, sliding_window=window, sliding_layers=sliding,
            tie_embeddings=bool(f.get("tie_word_embeddings", family in GEMMAS)), padding_idx=pad,
            # dynamic rope exists to run past max_position_embeddings, by up to its factor
            max_seq_len=max_seq_len or int(max_positions * (rope.factor if rope.type == "dynamic" else 1)),
            loss_chunk_tokens=loss_chunk_tokens, attention=attention, fused=fused,
        )
    except ValueError as err:
        raise HFModelError(f"{where} ({family}): {err}") from None

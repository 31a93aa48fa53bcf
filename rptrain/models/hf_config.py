"""A Hugging Face checkpoint's config.json -> the DecoderConfig of the one decoder.

Every field of config.json is either read (it changes the math and rptrain does the same), or
known to be harmless (token ids, dtype, cache settings, ...), or refused with `HFModelError`:
one line naming the field, the family and what is supported. Nothing is silently ignored.
Defaults for absent fields are transformers' own for that family. What a family reads, refuses
and switches on is its record in `families.py`; the fields' types are in `hf_fields.py`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rptrain.models.decoder_config import DecoderConfig, MoeConfig
from rptrain.models.families import FAMILIES, Family, family
from rptrain.models.hf_fields import COMMON, HARMLESS, ROPE_TYPES_OF, type_error
from rptrain.models.rope import ROPE_TYPES, Rope


class HFModelError(ValueError):
    """config.json or the weights of a Hugging Face folder that rptrain cannot train exactly."""


ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},  # transformers' dynamic reads max_position_embeddings
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


class _Fields:
    """config.json with its family's record, for reading and for messages."""

    def __init__(self, raw: dict[str, Any], record: Family, where: str):
        self.raw, self.record, self.family, self.where = raw, record, record.model_type, where

    def fail(self, field: str, why: str) -> HFModelError:
        value = json.dumps(self.raw.get(field)) if field in self.raw else "(absent)"
        value = value if len(value) <= 80 else value[:77] + "..."  # long_factor lists: keep the line short
        return HFModelError(f"{self.where}: {field}={value} ({self.family}): {why}")

    def get(self, field: str, default: Any = None) -> Any:
        """The value, else the family's default for an absent or null field, else `default`."""
        value = self.raw.get(field)
        return self.record.defaults.get(field, default) if value is None else value

    def opt(self, field: str, default: Any = None) -> Any:
        """Like get, but an explicit null stays None (soft-capping, sliding_window)."""
        return self.raw[field] if field in self.raw else self.record.defaults.get(field, default)

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
        raw = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise HFModelError(f"{file}: cannot be read as JSON ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if not isinstance(raw, dict):
        raise HFModelError(f"{file}: holds a JSON {type(raw).__name__}, not an object of config fields")
    return raw


def _check_rope_types(f: _Fields, label: str, params: Any) -> None:
    if not isinstance(params, dict):
        raise f.fail(label, "must be a JSON object of rotary settings")
    for key, value in params.items():
        why = type_error(key, value, ROPE_TYPES_OF)
        if why:
            raise f.fail(label, f"its {key} {why}")


def _rope(f: _Fields, params: dict[str, Any], label: str, max_positions: int) -> Rope:
    _check_rope_types(f, label, params)
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
    """(the rope of full-attention layers, the sliding layers' own or None).

    transformers (PreTrainedConfig.convert_rope_params_to_dict) takes a non-empty rope_scaling over
    rope_parameters, and a rope_theta beside them only where the dict has none: so does this."""
    scaling, new = f.raw.get("rope_scaling"), f.get("rope_parameters")
    if f.record.rope == "per_layer_type":
        if scaling and new is not None:
            raise f.fail("rope_scaling", "rope_parameters is given too: keep one of the two (rptrain cannot tell which rotary "
                                         "this family's transformers would read for each layer type)")
        if new is not None:
            full, local = dict(new.get("full_attention") or {}), dict(new.get("sliding_attention") or {})
        else:
            full, local = dict(f.get("rope_scaling", {})), {}
            local["rope_theta"] = f.get("rope_local_base_freq", 10000.0)
        full.setdefault("rope_theta", f.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", 10000.0)
        return _rope(f, full, "rope_parameters", max_positions), _rope(f, local, "rope_parameters", max_positions)
    label = "rope_scaling" if scaling else "rope_parameters" if new is not None else "rope_scaling"
    params = dict(scaling or new or {})
    params.setdefault("rope_theta", f.get("rope_theta", 10000.0))
    if f.raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", f.raw["partial_rotary_factor"])
    rope = _rope(f, params, label, max_positions)
    if rope.partial_rotary_factor != 1 and not f.record.partial_rotary:
        raise f.fail(label, f"partial_rotary_factor other than 1 is supported for {', '.join(n for n, r in FAMILIES.items() if r.partial_rotary)} only")
    return rope, None


def _layer_types(f: _Fields, n_layers: int) -> list[str]:
    """Each layer's attention type as transformers derives it when config.json has no layer_types."""
    pattern = f.record.layers
    if pattern == "sliding":
        return ["sliding_attention"] * n_layers
    if pattern == "max_window":
        first = f.get("max_window_layers", 28)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if pattern == "alternate":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if pattern == "every_nth":
        every = f.get("sliding_window_pattern", f.get("_sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    return ["full_attention"] * n_layers


def _sliding_layers(f: _Fields, n_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    window = f.opt("sliding_window")
    if f.record.window_switch and not f.get(f.record.window_switch, False):
        window = None  # transformers drops the window unless use_sliding_window
    types = f.raw.get("layer_types")
    if types is None:
        types = _layer_types(f, n_layers)
    if len(types) != n_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise f.fail("layer_types", f"needs {n_layers} entries, each full_attention or sliding_attention")
    if window is None:
        return None, ()
    return int(window), tuple(t == "sliding_attention" for t in types)


def _activation(f: _Fields) -> str:
    field, allowed = f.record.activation_field, f.record.activations
    value = f.get(field, "silu")
    if value not in allowed:
        raise f.fail(field, f"rptrain supports {' or '.join(allowed)} for this family")
    return allowed[value]


def _moe(f: _Fields, n_layers: int) -> MoeConfig | None:
    """The MoE layers as the family's transformers builds them (Qwen3MoeDecoderLayer, MixtralSparseMoeBlock)."""
    record = f.record.moe
    if record is None:
        return None
    new, old = f.raw.get("num_experts"), f.raw.get("num_local_experts")
    if new is not None and old is not None and new != old:
        raise f.fail("num_experts", f"num_local_experts={old} says otherwise: transformers reads them as one field; keep one")
    n_experts = int(new if new is not None else old if old is not None else f.get("num_experts"))
    layers = (True,) * n_layers
    if record.sparse_step:
        step, dense = int(f.get("decoder_sparse_step", 1)), set(f.get("mlp_only_layers", []))
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    norm = record.norm_topk if isinstance(record.norm_topk, bool) else bool(f.get(record.norm_topk, False))
    size_field = record.expert_size_field
    return MoeConfig(
        n_experts=n_experts, top_k=int(f.get("num_experts_per_tok")), layers=layers,
        expert_size=int(f.need(size_field) if size_field == "intermediate_size" else f.get(size_field)),
        routing=record.routing, norm_topk=norm, router_name=record.router, bias=record.bias, activation=record.activation,
        # As transformers 5.25 reads them; 5.17 hard-coded 1.702 and 7.0 (the published values) whatever the config said.
        swiglu_alpha=float(f.get("swiglu_alpha", 1.702)), swiglu_limit=float(f.get("swiglu_limit", 7.0)),
        interleaved=record.interleaved, aux_coef=float(f.get("router_aux_loss_coef", 0.001)),
        aux_in_loss=bool(f.get("output_router_logits", False)))


def _check(f: _Fields) -> None:
    """Every field known to the family, of its type, at a value rptrain computes as transformers does."""
    record, raw = f.record, f.raw
    quantized = raw.get("quantization_config")
    method = quantized.get("quant_method") if isinstance(quantized, dict) else None
    if quantized is not None and not (record.mxfp4 and method == "mxfp4"):
        raise f.fail("quantization_config", f"quantized weights ({method or 'unknown method'}) are not supported: save a bf16 copy "
                                            "first (transformers: from_pretrained(..., quantization_config=...(dequantize=True)), "
                                            "then save_pretrained)")
    for arch in f.get("architectures", []) if type_error("architectures", raw.get("architectures")) is None else ():
        if not arch.endswith("ForCausalLM"):
            raise f.fail("architectures", "rptrain trains causal language models (*ForCausalLM) only")
    allowed = HARMLESS | COMMON | record.reads | record.harmless | ({"quantization_config"} if record.mxfp4 else set())
    for key, value in raw.items():
        if key == "quantization_config":
            continue  # checked above
        if key not in allowed:
            raise f.fail(key, f"rptrain does not know this field, which may change the model's math; the {f.family} fields it reads: "
                              f"{', '.join(sorted(COMMON | record.reads))}")
        why = type_error(key, value)
        if why:
            raise f.fail(key, why)
    for key in record.dropouts:
        f.zero(key)
    for key, (value, why) in record.must.items():
        if f.get(key, value) != value:
            raise f.fail(key, why)


def decoder_config(raw: Any, where: str = "config.json", max_seq_len: int | None = None,
                   loss_chunk_tokens: int = 4096, attention: str = "auto", fused: bool = False) -> DecoderConfig:
    """Raise HFModelError (one line) for anything rptrain would not compute as transformers does."""
    if not isinstance(raw, dict):
        raise HFModelError(f"{where}: holds a JSON {type(raw).__name__}, not an object of config fields")
    record = family(raw.get("model_type"))
    if record is None:
        raise HFModelError(f"{where}: model_type={json.dumps(raw.get('model_type'))} is not supported: rptrain trains {', '.join(FAMILIES)}")
    f = _Fields(raw, record, where)
    _check(f)
    hidden, heads = int(f.need("hidden_size")), int(f.need("num_attention_heads"))
    n_layers = int(f.need("num_hidden_layers"))
    head_dim = int(f.get("head_dim", hidden // heads))
    max_positions = int(f.get("max_position_embeddings", 2048))
    rope, local_rope = _ropes(f, max_positions)
    window, sliding = _sliding_layers(f, n_layers)
    activation = _activation(f)
    bias = bool(f.get("attention_bias", False))
    vocab = int(f.need("vocab_size"))
    pad = f.raw.get("pad_token_id")
    if pad is not None and not -vocab <= int(pad) < vocab:
        raise f.fail("pad_token_id", f"must be a token id below vocab_size={vocab} or null")
    pad = None if pad is None else int(pad) % vocab  # -1: the last row, as nn.Embedding reads it
    switches = dict(record.switches)
    gemma2 = record.gemma2
    try:
        moe = _moe(f, n_layers)
        return DecoderConfig(
            vocab_size=vocab, hidden_size=hidden, n_layers=n_layers, n_heads=heads,
            n_kv_heads=int(f.get("num_key_value_heads", heads)), head_dim=head_dim,
            intermediate_size=int(f.need("intermediate_size")), moe=moe,
            norm_eps=float(f.get("rms_norm_eps", 1e-6)), norm_offset=record.gemma, activation=activation,
            qkv_bias=bias or switches.pop("qkv_bias", False), o_bias=bias, mlp_bias=bool(f.get("mlp_bias", False)),
            embed_scale=math.sqrt(hidden) if record.gemma else None,
            attn_scale=float(f.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma2 else None,
            attn_softcap=f.opt("attn_logit_softcapping") if gemma2 else None,
            final_softcap=f.opt("final_logit_softcapping") if gemma2 else None,
            rope=rope, local_rope=local_rope, sliding_window=window, sliding_layers=sliding,
            tie_embeddings=bool(f.get("tie_word_embeddings", False)), padding_idx=pad,
            # dynamic rope exists to run past max_position_embeddings, by up to its factor
            max_seq_len=max_seq_len or int(max_positions * (rope.factor if rope.type == "dynamic" else 1)),
            loss_chunk_tokens=loss_chunk_tokens, attention=attention, fused=fused, **switches,
        )
    except ValueError as err:
        raise HFModelError(f"{where} ({record.model_type}): {err}") from None

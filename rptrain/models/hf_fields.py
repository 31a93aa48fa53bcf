"""The config.json fields rptrain knows, and the JSON type of each: a value of the wrong type
(`"hidden_size": 32.5`, `"rope_scaling": "linear"`, `true` for a count) is refused before anything
reads it, so no field is ever silently truncated, coerced or misread.
"""
from __future__ import annotations

import math
from typing import Any

# Fields that never change the forward or backward pass (their values are not read).
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

MAX_MODULES = 2**14
# kind -> (the test, what the message says it must be). null is accepted for every field
# (transformers reads it as "use the default"); a required field that is null is refused where it is read.
KINDS = {
    "count": (lambda v: type(v) is int and v >= 1, "a positive integer"),
    # Counts of things built one by one (layers, experts, heads): a crafted 10**9 held a run in a
    # billion-entry list for minutes instead of being refused (issue 31's campaign). Real models have hundreds.
    "modules": (lambda v: type(v) is int and 1 <= v <= MAX_MODULES, f"a positive integer of at most {MAX_MODULES:,}"),
    "index": (lambda v: type(v) is int, "an integer"),
    "size": (lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    "number": (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    "bool": (lambda v: type(v) is bool, "true or false"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "texts": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "indices": (lambda v: isinstance(v, list) and all(type(x) is int for x in v), "a list of integers"),
    "token_ids": (lambda v: type(v) is int or (isinstance(v, list) and all(type(x) is int for x in v)), "a token id or a list of them"),
}
TYPES: dict[str, str] = {
    **dict.fromkeys(["vocab_size", "hidden_size", "intermediate_size", "head_dim", "max_position_embeddings", "max_sequence_length",
                     "original_max_position_embeddings", "sliding_window", "sliding_window_size", "sliding_window_pattern",
                     "_sliding_window_pattern", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"], "count"),
    **dict.fromkeys(["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts", "num_local_experts"], "modules"),
    **dict.fromkeys(["max_window_layers"], "size"),
    **dict.fromkeys(["pad_token_id"], "index"),
    **dict.fromkeys(["bos_token_id", "eos_token_id"], "token_ids"),
    **dict.fromkeys(["rms_norm_eps", "attention_dropout", "embd_pdrop", "resid_pdrop", "rope_theta", "rope_local_base_freq",
                     "partial_rotary_factor", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                     "router_aux_loss_coef", "router_jitter_noise", "swiglu_alpha", "swiglu_limit", "initializer_range"], "number"),
    **dict.fromkeys(["tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "use_bidirectional_attention",
                     "norm_topk_prob", "output_router_logits", "use_cache"], "bool"),
    **dict.fromkeys(["model_type", "hidden_act", "hidden_activation"], "text"),
    **dict.fromkeys(["rope_scaling", "rope_parameters"], "object"),
    **dict.fromkeys(["architectures", "layer_types"], "texts"),
    **dict.fromkeys(["mlp_only_layers"], "indices"),
}
# Inside rope_scaling / rope_parameters (a flat one, or Gemma-3's per layer type).
ROPE_TYPES_OF = {
    **dict.fromkeys(["rope_type", "type"], "text"),
    **dict.fromkeys(["original_max_position_embeddings"], "count"),
    **dict.fromkeys(["rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"], "number"),
    **dict.fromkeys(["truncate"], "bool"),
}


def type_error(field: str, value: Any, kinds: dict[str, str] = TYPES) -> str | None:
    """Why `value` cannot be `field` ("must be a positive integer"), or None when it can (or the field is not typed here)."""
    kind = kinds.get(field)
    if value is None or kind is None:
        return None
    check, wanted = KINDS[kind]
    return None if check(value) else f"must be {wanted}"

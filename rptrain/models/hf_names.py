"""Parameter names of a decoder `nn.Sequential` <-> the names in a Hugging Face checkpoint.

The convention every decoder in rptrain follows (presets and `model=hf` alike), so that loading,
export and LoRA adapters need no per-family name tables:

    Sequential element 0        embedding       "0.embed_tokens.weight"      <-> "model.embed_tokens.weight"
    Sequential element i+1      decoder layer i "{i+1}.<suffix>"             <-> "model.layers.{i}.<suffix>"
    Sequential element L+1      final norm      "{L+1}.norm.weight"          <-> "model.norm.weight"
                                LM head         "{L+1}.lm_head.weight"       <-> "lm_head.weight"

`<suffix>` is transformers' own name inside the layer for that family (`self_attn.q_proj.weight`,
`mlp.gate_up_proj.weight`, `input_layernorm.weight`, ...), so a layer's modules carry the same names.
MoE layers carry transformers' in-memory names (`mlp.gate.weight`, `mlp.experts.gate_up_proj`); where a
family's checkpoint spells its experts otherwise (one tensor per expert), expert_names.py translates.
"""
from __future__ import annotations


def hf_name(seq_name: str, n_layers: int) -> str:
    """'3.self_attn.q_proj.weight' -> 'model.layers.2.self_attn.q_proj.weight' for a model of n_layers layers."""
    index, _, rest = seq_name.partition(".")
    if not index.isdigit() or not rest:
        raise ValueError(f"{seq_name!r} is not a decoder Sequential parameter name")
    position = int(index)
    if position == 0:
        return f"model.{rest}"
    if position <= n_layers:
        return f"model.layers.{position - 1}.{rest}"
    if position == n_layers + 1:
        return rest if rest.startswith("lm_head.") else f"model.{rest}"
    raise ValueError(f"{seq_name!r}: element {position} is past the head of a {n_layers}-layer decoder")


def seq_name(name: str, n_layers: int) -> str:
    """The inverse of `hf_name`: 'model.layers.2.mlp.up_proj.weight' -> '3.mlp.up_proj.weight'."""
    if name.startswith("lm_head."):
        return f"{n_layers + 1}.{name}"
    if name.startswith("model.layers."):
        index, _, rest = name[len("model.layers."):].partition(".")
        if not index.isdigit() or int(index) >= n_layers or not rest:
            raise ValueError(f"{name!r} names no layer of a {n_layers}-layer decoder")
        return f"{int(index) + 1}.{rest}"
    if name.startswith("model.embed_tokens."):
        return f"0.{name[len('model.'):]}"
    if name.startswith("model.norm."):
        return f"{n_layers + 1}.{name[len('model.'):]}"
    raise ValueError(f"{name!r} is not a decoder parameter this convention knows")

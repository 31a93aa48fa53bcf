"""Our MoE tensors <-> the tensors of a family's checkpoint on disk.

Our names are transformers' in-memory ones (hf_names.py): `mlp.gate.weight` (or GPT-OSS's
`mlp.router.*`), `mlp.experts.gate_up_proj` (E, 2I, D) and `mlp.experts.down_proj` (E, D, I).
Qwen3-MoE and Mixtral checkpoints store each expert's matrices apart
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`, ...);
GPT-OSS stores them fused, as they are in memory. `parts` lists, for one of our tensors, the
checkpoint tensors that fill it and where each goes, for loading and for export alike.
"""
from __future__ import annotations

from rptrain.models.families import Family

Index = tuple  # an index into our tensor: () is the whole, (e, slice(a, b)) expert e's rows a:b


def parts(name: str, shape: tuple[int, ...], record: Family) -> list[tuple[str, Index]]:
    """[(checkpoint name, index into our tensor `name` (a transformers name) of shape `shape`)]."""
    moe = record.moe
    layer, sep, inner = name.partition(".mlp.")
    if moe is None or not sep or not name.startswith("model.layers."):
        return [(name, ())]
    block = f"{layer}.{moe.block}."
    if not inner.startswith("experts.") or moe.per_expert is None:
        return [(block + inner, ())]
    gate, up, down = moe.per_expert
    experts = shape[0]
    if inner == "experts.down_proj":
        return [(f"{block}experts.{e}.{down}.weight", (e,)) for e in range(experts)]
    if inner == "experts.gate_up_proj":
        half = shape[1] // 2
        return [item for e in range(experts) for item in ((f"{block}experts.{e}.{gate}.weight", (e, slice(0, half))),
                                                        (f"{block}experts.{e}.{up}.weight", (e, slice(half, 2 * half))))]
    raise ValueError(f"{name}: an expert tensor {record.model_type} checkpoints do not hold")

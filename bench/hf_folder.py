"""A random-initialised Llama-3.1-8B-shaped Hugging Face folder (bf16 safetensors shards, config.json), written
without a model: each shard's tensors are drawn (on the GPU when there is one), streamed to disk by rptrain's
own safetensors writer and dropped, so the memory used is one shard (at most ``--shard-gib``), never the model.

    python3 bench/hf_folder.py --out /tmp/llama-3.1-8b           # 8.03 B parameters, 14.96 GiB on disk
    python3 bench/hf_folder.py --out /tmp/tiny --tiny            # the same layout at CI size

Matrices are N(0, 0.02) as transformers initialises Llama, norms are ones; the values are meaningless, the
shapes, names, dtype and config are the real model's. No tokenizer: runs read data=synthetic_tokens.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import torch

from common import emit, parser
from rptrain.models.hf_export import write_safetensors

# config.json of meta-llama/Llama-3.1-8B (the fields transformers reads; the values are the model card's).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "initializer_range": 0.02, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "bos_token_id": 0, "eos_token_id": 1}


def shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every weight of a LlamaForCausalLM with this config, in checkpoint order, under transformers' names."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head = config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    yield "model.embed_tokens.weight", (v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (d,)
        yield p + "self_attn.q_proj.weight", (q, d)
        yield p + "self_attn.k_proj.weight", (kv, d)
        yield p + "self_attn.v_proj.weight", (kv, d)
        yield p + "self_attn.o_proj.weight", (d, q)
        yield p + "post_attention_layernorm.weight", (d,)
        yield p + "mlp.gate_proj.weight", (f, d)
        yield p + "mlp.up_proj.weight", (f, d)
        yield p + "mlp.down_proj.weight", (d, f)
    yield "model.norm.weight", (d,)
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", (v, d)


def grouped(named: list[tuple[str, tuple[int, ...]]], max_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    groups: list[list] = [[]]
    size = 0
    for name, shape in named:
        nbytes = torch.Size(shape).numel() * 2
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    return groups


def random_weight(name: str, shape: tuple[int, ...], generator: torch.Generator, device: str) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    return torch.randn(shape, generator=generator, dtype=torch.bfloat16, device=device).mul_(0.02)


def write_folder(out: Path, config: dict, device: str, shard_bytes: int, seed: int = 0) -> int:
    """Write the folder; returns its parameter count."""
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device).manual_seed(seed)
    groups = grouped(list(shapes(config)), shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for group, file in zip(groups, files):
        tensors = {name: random_weight(name, shape, generator, device) for name, shape in group}
        write_safetensors(tensors, out / file, torch.bfloat16)
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({k: config[k] for k in ("bos_token_id", "eos_token_id")}) + "\n")
    return total


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shard-gib", type=float, default=2.0, help="largest shard (the memory the writer holds)")
    args = p.parse_args()
    config = {**LLAMA_31_8B, **(TINY if args.tiny else {})}
    start = time.perf_counter()
    params = write_folder(args.out, config, args.device, int(args.shard_gib * 2**30))
    on_disk = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    emit(bench="hf_folder", out=str(args.out), params=params, gib_on_disk=round(on_disk / 2**30, 2),
         write_s=round(time.perf_counter() - start, 1), device=args.device, tiny=args.tiny)


if __name__ == "__main__":
    main()

"""Write a decoder `nn.Sequential` as a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads.

    config.json                      the architecture (the caller's config.json dict), dtype and weight tying updated
    model.safetensors                the weights under transformers' names (hf_names.py), in one dtype;
    model-0000i-of-0000n.safetensors   above max_shard_bytes: shards plus model.safetensors.index.json
    model.safetensors.index.json
    generation_config.json           bos/eos/pad token ids
    tokenizer.json, ...              copied from the tokenizer's folder, when there is one

Each shard is streamed: its header first, then every tensor cast a chunk at a time from wherever it lives
(host or GPU), so exporting needs a chunk of extra memory, not a shard's or a second copy of the model; its
written pages leave the page cache every GiB (rptrain.page_cache), as a checkpoint's do. A tied embedding/head matrix is written once, as transformers does.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from rptrain.models.expert_names import parts
from rptrain.models.families import Family, family
from rptrain.models.hf_names import hf_name
from rptrain.page_cache import SYNC_BYTES, drop_written

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# What transformers reads from a tokenizer folder; the ones present are copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hf_state(state: Mapping[str, torch.Tensor], n_layers: int, record: Optional[Family] = None) -> tuple[dict[str, torch.Tensor], bool]:
    """Our state dict under the checkpoint's names, and whether the head is tied to the embedding
    (no head tensor, or the embedding's very memory): then it is left out. An MoE family's experts are
    written as its checkpoints store them (expert_names: one tensor per expert, or fused)."""
    named = {}
    for name, tensor in state.items():
        hf = hf_name(name, n_layers)
        for part, index in (parts(hf, tuple(tensor.shape), record) if record is not None else [(hf, ())]):
            named[part] = tensor[index] if index else tensor
    if EMBED not in named:
        raise ValueError(f"no embedding ({EMBED}) among the {len(named)} tensors: not a decoder of the hf_names convention")
    head, embed = named.get(HEAD), named[EMBED]
    # data_ptr, not the storage: the engine's master weights are views into a few flat tensors.
    tied = head is None or (head.data_ptr() == embed.data_ptr() and head.shape == embed.shape and head.stride() == embed.stride())
    if tied:
        named.pop(HEAD, None)
    return named, tied


def _shards(named: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards in order, each at most max_shard_bytes (a bigger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


# safetensors' names of the dtypes an export writes (its format's header; safetensors/src/tensor.rs).
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
CHUNK_ELEMENTS = 16 * 2**20  # a tensor is cast and written this many elements at a time


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    """One safetensors file of ``tensors`` cast to ``dtype``, streamed: the header (computed from the
    shapes), then each tensor cast a chunk at a time from wherever it lives (host or GPU). Needs a
    chunk of memory, not a copy of the shard (``safetensors.torch.save_file`` builds every tensor's
    bytes first)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        written = synced = 8 + len(encoded)
        for t in tensors.values():
            flat = t.detach().reshape(-1)
            for start in range(0, flat.numel(), CHUNK_ELEMENTS):
                chunk = flat[start : start + CHUNK_ELEMENTS].to("cpu", dtype).contiguous()
                f.write(chunk.view(torch.uint8).numpy())
                written += chunk.numel() * dtype.itemsize
                if written - synced >= SYNC_BYTES:  # a 5 GiB shard's pages do not all wait in memory
                    drop_written(f, written)
                    synced = written
        drop_written(f, written)
        os.fsync(f.fileno())  # the file's size and times too


def write_weights(named: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    shards = _shards(named, dtype, max_shard_bytes)
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:  # an earlier export's shards
        stale.unlink(missing_ok=True)
    files = ["model.safetensors"] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for names, file in zip(shards, files):
        write_safetensors({name: named[name] for name in names}, out_dir / file, dtype)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * dtype.itemsize for t in named.values())},
                 "weight_map": {name: file for names, file in zip(shards, files) for name in names}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def tokenizer_folder(tokenizer: Optional[str | Path]) -> Optional[Path]:
    """The folder whose tokenizer files go with the export: a folder, or the folder of a tokenizer.json; None for 'byte'."""
    if tokenizer is None or str(tokenizer) == "byte":
        return None
    path = Path(tokenizer).expanduser()
    return path if path.is_dir() else path.parent


def hf_export(
    model: nn.Module | Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    out_dir: str | Path,
    dtype: Optional[torch.dtype] = None,
    tokenizer: Optional[str | Path] = None,
    generation_config: Optional[Mapping[str, Any]] = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write `model` (a decoder Sequential, or its state dict) to `out_dir` as a Hugging Face folder.

    config: the config.json fields of the same architecture (model_type, architectures, sizes, ...);
    dtype: the weights' dtype on disk (None: the model's own, which must be one dtype);
    tokenizer: a tokenizer folder or tokenizer.json whose folder's tokenizer files are copied;
    generation_config: generation_config.json's fields (None: bos/eos/pad ids from `config`).
    """
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    named, tied = hf_state(state, int(config["num_hidden_layers"]), family(config.get("model_type")))
    if dtype is None:
        dtypes = {t.dtype for t in named.values() if t.is_floating_point()}
        if len(dtypes) != 1:
            raise ValueError(f"the model mixes dtypes {sorted(map(str, dtypes))}: pass dtype=")
        dtype = dtypes.pop()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_weights(named, out, dtype, max_shard_bytes)
    dtype_name = str(dtype).removeprefix("torch.")
    # transformers 5 writes "dtype", 4.x "torch_dtype"; both versions read the other key too.
    written = {**config, "torch_dtype": dtype_name, "tie_word_embeddings": tied}
    written.pop("quantization_config", None)  # weights are written as `dtype`: a source's MXFP4 experts were dequantized at load
    if "dtype" in written:
        written["dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    if generation_config is None:
        generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(dict(generation_config), indent=2, sort_keys=True) + "\n")
    source = tokenizer_folder(tokenizer)
    for name in TOKENIZER_FILES if source is not None else ():
        if (source / name).is_file() and (source / name).resolve() != (out / name).resolve():
            shutil.copyfile(source / name, out / name)
    return out

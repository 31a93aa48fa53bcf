"""`model=hf`: a Hugging Face folder (config.json + *.safetensors) as the decoder Sequential.

The model is built on the meta device from config.json alone (hf_config), then its storage is
allocated once and every tensor of the checkpoint is read from the memory-mapped shards and
converted into place one at a time: loading never holds a second copy of the weights. The trainer
reads it a layer at a time instead (layer_loader), as the engine takes each layer in.
Tensor names map through hf_names; a tied head reuses the embedding (transformers ties the same way).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from rptrain.models.decoder import Device, build_decoder
from rptrain.models.hf_config import HFModelError, decoder_config, read_config_json
from rptrain.models.expert_names import Index, parts
from rptrain.models.families import Family, family
from rptrain.models.hf_names import hf_name
from rptrain.models.llama_weights import listing
from rptrain.models.mxfp4 import dequantize
from rptrain.models.registry import register_model


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"  # GPT-OSS's quantized experts: <name>_blocks and <name>_scales
Plan = dict[str, tuple[str, Index]]  # checkpoint tensor -> (our parameter, the index into it that it fills)
# safetensors' names of the dtypes a weight may have; any other (I32, U8, F8_*, ...) is refused, never cast.
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


@contextmanager
def open_shard(file: Path) -> Iterator[Any]:
    """safe_open, with any failure to read the shard (truncated, not safetensors) as one line naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as err:
        raise HFModelError(f"{file}: cannot be read as safetensors ({err}): the file is damaged or incomplete; "
                           f"download or save it again") from None


def weight_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the shard holding it (model.safetensors.index.json, else every shard's header)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise HFModelError(f"{index}: not a safetensors index ({err!r})") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise HFModelError(f"{index} names shards that are not in the folder: {listing(missing)}")
        return {name: path / file for name, file in weight_map.items()}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (it has {listing(bins)}: save it with save_pretrained(..., safe_serialization=True))" if bins else ""
        raise HFModelError(f"model.path={path}: no *.safetensors weights{hint}")
    files = {}
    for shard in shards:
        with open_shard(shard) as f:
            files.update((name, shard) for name in f.keys())
    return files


def _mxfp4_files(plan: Plan, files: dict[str, Path]) -> dict[str, Path]:
    """`files` plus, for each planned tensor stored as MXFP4 blocks, the shard of its blocks."""
    return {**files, **{n: files[n + MXFP4_BLOCKS] for n in plan if n not in files}}


def _by_file(names, files: dict[str, Path]) -> dict[Path, list[str]]:
    """Tensor names grouped by shard, so each shard is opened once."""
    out: dict[Path, list[str]] = {}
    for name in names:
        out.setdefault(files[name], []).append(name)
    return out


def _plan(model: nn.Sequential, files: dict[str, Path], path: Path, record: Family) -> Plan:
    """Where every checkpoint tensor goes: (our parameter name, index into it); raise if names, dtypes or
    shapes do not match. Expert matrices stored one per expert fill slices of ours (expert_names)."""
    n_layers = len(model) - 2
    params = dict(model.named_parameters())  # a tied head is not listed: it is the embedding
    wanted = {part: (name, index) for name, p in params.items()
              for part, index in parts(hf_name(name, n_layers), tuple(p.shape), record)}
    tied = model[-1].tied
    plan, unexpected = {}, []
    for name in files:
        if name in wanted:
            plan[name] = wanted[name]
        elif record.mxfp4 and name.endswith(MXFP4_BLOCKS) and name.removesuffix(MXFP4_BLOCKS) in wanted:
            plan[name.removesuffix(MXFP4_BLOCKS)] = wanted[name.removesuffix(MXFP4_BLOCKS)]  # dequantized at load
            if name.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES not in files:
                raise HFModelError(f"model.path={path}: {name} has no {MXFP4_SCALES.lstrip('_')} tensor beside it")
        elif record.mxfp4 and name.endswith(MXFP4_SCALES) and name.removesuffix(MXFP4_SCALES) in wanted:
            continue  # read with its blocks
        elif name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # a derived table of old files; a tied head's copy (the embedding wins, as in transformers)
        else:
            unexpected.append(name)
    missing = sorted(set(wanted) - set(plan))
    if missing or unexpected:
        raise HFModelError(f"model.path={path}: the weights do not match config.json: missing {len(missing)} "
                           f"[{listing(missing)}], unexpected {len(unexpected)} [{listing(unexpected)}]")
    by_file = _by_file(plan, _mxfp4_files(plan, files))
    wrong = []
    for file, names in by_file.items():
        with open_shard(file) as f:
            for n in names:
                if n not in files:  # MXFP4: (E, rows, in / 32, 16) bytes for our (E, in, rows)
                    blocks, ours = tuple(f.get_slice(n + MXFP4_BLOCKS).get_shape()), tuple(params[plan[n][0]][plan[n][1]].shape)
                    if f.get_slice(n + MXFP4_BLOCKS).get_dtype() != "U8" or blocks != (ours[0], ours[2], ours[1] // 32, 16):
                        wrong.append(f"{n + MXFP4_BLOCKS} {blocks} vs MXFP4 blocks of {ours}")
                    continue
                dtype = f.get_slice(n).get_dtype()
                if dtype not in FLOAT_DTYPES:
                    raise HFModelError(f"{file}: tensor {n} is {dtype}, not a floating-point weight; rptrain does not cast "
                                       f"it silently (quantized checkpoints are not supported): use a bf16/fp16/fp32 export")
                ours = tuple(params[plan[n][0]][plan[n][1]].shape)
                if tuple(f.get_slice(n).get_shape()) != ours:
                    wrong.append(f"{n} {tuple(f.get_slice(n).get_shape())} vs {ours}")
    if wrong:
        raise HFModelError(f"model.path={path}: tensor shapes differ from config.json (file vs model): {listing(wrong)}")
    return plan


def load_hf_weights(model: nn.Sequential, files: dict[str, Path], plan: Plan, layer: int | None = None) -> None:
    """Copy each tensor from its memory-mapped shard into the allocated model, converting its dtype;
    ``layer``: only that layer's tensors (the rest of the model may still be on the meta device)."""
    params = dict(model.named_parameters())
    if layer is not None:
        plan = {name: place for name, place in plan.items() if place[0].split(".", 1)[0] == str(layer)}
    by_file = _by_file(plan, _mxfp4_files(plan, files))
    with torch.no_grad():
        for file, names in by_file.items():
            with open_shard(file) as f:
                for name in names:
                    ours, index = plan[name]
                    if name not in files:  # MXFP4 blocks here, their scales in their own shard
                        with open_shard(files[name + MXFP4_SCALES]) as g:
                            scales = g.get_tensor(name + MXFP4_SCALES)
                        params[ours][index].copy_(dequantize(f.get_tensor(name + MXFP4_BLOCKS), scales, torch.float32))
                    else:
                        params[ours][index].copy_(f.get_tensor(name))


def layer_loader(model: nn.Sequential, path: str) -> Callable[[int], None]:
    """For ``model`` (build_hf's on the meta device, its layers made real one at a time elsewhere): fills
    layer ``i``'s tensors from the memory-mapped shards, so the folder is read a layer at a time."""
    folder = Path(path).expanduser()
    files = weight_files(folder)
    plan = _plan(model, files, folder, family(read_config_json(folder)["model_type"]))
    return lambda i: load_hf_weights(model, files, plan, layer=i)


@register_model("hf")
def build_hf(path: str, device: Device = None, dtype: torch.dtype | None = None, max_seq_len: int | None = None,
             loss_chunk_tokens: int = 4096, attention: str = "auto", vocab_size: int | None = None,
             fused: bool = False) -> nn.Sequential:
    """The decoder of the folder `path`, with its weights (device="meta": checked, nothing loaded).

    max_seq_len None: config.json's max_position_embeddings. vocab_size (passed by the trainer) is
    the data's vocabulary, which the model's embedding must cover.
    """
    if attention not in ("auto", "sdpa", "flex"):
        raise HFModelError(f"model.attention={attention}: use auto, sdpa or flex")
    folder = Path(path).expanduser()
    raw = read_config_json(folder)
    cfg = decoder_config(raw, f"{folder / 'config.json'}", max_seq_len, loss_chunk_tokens, attention, fused)
    if vocab_size is not None and vocab_size > cfg.vocab_size:
        raise HFModelError(f"model.path={path}: the data has {vocab_size} token ids (its tokenizer or data.vocab_size) but "
                           f"the model embeds {cfg.vocab_size}: use the folder's own tokenizer")
    model = build_decoder(cfg, "meta", dtype)
    files = weight_files(folder)
    plan = _plan(model, files, folder, family(raw["model_type"]))
    if device is not None and torch.device(device).type == "meta":
        return model
    model = model.to_empty(device=torch.get_default_device() if device is None else device)
    if cfg.tie_embeddings:  # one Parameter in both places, whatever to_empty did
        model[-1].lm_head.weight = model[0].embed_tokens.weight
    load_hf_weights(model, files, plan)
    return model

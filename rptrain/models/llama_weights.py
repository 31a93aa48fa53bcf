"""Load a local checkpoint into a decoder Sequential (a preset or `model=hf`).

Accepts our own state-dict names ("0.embed_tokens.weight", "3.self_attn.q_proj.weight", ...) and
Hugging Face names ("model.layers.2.self_attn.q_proj.weight", ...): they differ only by the
prefix (rptrain.models.hf_names). HF stores q/k projections permuted for the rotate_half rotary
layout, which is the layout `apply_rotary` uses, so their tensors are copied as they are. (Meta's
original consolidated.*.pth files use interleaved pairs and are not supported.)
"""

import functools
from pathlib import Path

import torch
from torch import nn

from rptrain.models.hf_names import seq_name


def _from_hf_name(name: str, n_layers: int) -> str | None:
    """Our name for an HF tensor; None for tensors to drop; unknown names pass through."""
    if name.endswith("rotary_emb.inv_freq"):  # a derived table in old HF files
        return None
    try:
        return seq_name(name, n_layers)
    except ValueError:
        return name


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A .pt/.bin file, a .safetensors file, or a folder of .safetensors (else .bin/.pt) shards."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted([*path.glob("*.bin"), *path.glob("*.pt")])
        if not files:
            raise FileNotFoundError(f"no .safetensors, .bin or .pt files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(path)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise ImportError(
                    f"{file} is a safetensors file, which needs the optional package: pip install safetensors"
                ) from None
            load = functools.partial(load_file, file)
        else:
            load = functools.partial(torch.load, file, map_location="cpu", weights_only=True, mmap=True)
        try:
            state.update(load())
        except Exception as err:  # noqa: BLE001 - a damaged or hostile file (UnpicklingError, SafetensorError, ...): name it
            raise ValueError(f"{file} cannot be read as weights ({type(err).__name__}: {str(err)[:200]})") from err
    return state


def listing(names: list[str], limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_weights(model: nn.Sequential, path: str | Path) -> None:
    """Copy a checkpoint into `model` in place (casting to each parameter's dtype)."""
    state = read_state_dict(path)
    if any(k.startswith(("model.", "lm_head.")) for k in state):
        n_layers = len(model) - 2
        state = {new: t for k, t in state.items() if (new := _from_hf_name(k, n_layers)) is not None}

    expected = model.state_dict(keep_vars=True)
    # A tied embedding/head Parameter appears under two names; files may hold either.
    groups: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(name)
    for names in groups.values():
        present = [n for n in names if n in state]
        if len(present) > 1 and not all(torch.equal(state[present[0]], state[n]) for n in present[1:]):
            raise ValueError(f"checkpoint has different tensors for {present}, but the model ties them")
        for name in names if present else []:
            state.setdefault(name, state[present[0]])

    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: "
            f"missing {len(missing)} [{listing(missing)}], unexpected {len(unexpected)} [{listing(unexpected)}]"
        )
    wrong = [f"{n} {tuple(state[n].shape)} vs {tuple(t.shape)}" for n, t in expected.items() if state[n].shape != t.shape]
    if wrong:
        raise ValueError(f"checkpoint {path} has wrong shapes (file vs model): {listing(wrong)}")
    if any(t.is_meta for t in expected.values()):
        raise ValueError("model is on the meta device; materialise it first, e.g. model.to_empty(device='cpu')")
    model.load_state_dict(state)

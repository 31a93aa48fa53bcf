"""The model group -> an nn.Sequential, plus the fingerprint that ties checkpoints to a model.

Model configs map one-to-one onto rptrain.models.build_model(name, **kwargs); the trainer adds
what only it knows: the dtype, the device (meta for dry runs) and, for language models without a
model.vocab_size, the data's vocabulary size.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from rptrain.models import HFModelError, load_weights
from rptrain.models.hf_model import layer_loader
from rptrain.models import build_model as build_registered

from .errors import ConfigError, one_line
from .lora import with_lora
from .run_weights import load_run_weights, run_checkpoint

IMAGE, LM = "image", "lm"
BUILDER = "rptrain.models.build_model"  # the one _target_ a model config may name
# Which data each kind of model trains on (the data group's `name`).
DATA_FOR = {IMAGE: ("cifar100", "cifar10", "synthetic"), LM: ("text", "synthetic_tokens", "chat")}


def model_kind(model_cfg: DictConfig) -> str:
    """'lm' for the decoders (they take (ids, targets) and return the loss), else 'image'."""
    return LM if "vocab_size" in model_cfg or model_cfg.get("name") == "hf" else IMAGE


def data_kind(data_cfg: DictConfig) -> str:
    return next(kind for kind, names in DATA_FOR.items() if data_cfg.name in names)


def build_model(cfg: DictConfig, dtype: torch.dtype, device: Any = None, vocab_size: Optional[int] = None) -> nn.Sequential:
    """Build cfg.model; `vocab_size` fills in a language model's null model.vocab_size."""
    return _build(cfg, dtype, device, vocab_size, stream=False)[0]


def build_model_streamed(cfg: DictConfig, dtype: torch.dtype, vocab_size: Optional[int] = None) -> tuple[nn.Sequential, Optional["Materialiser"]]:
    """cfg.model for the engine to make real as it takes it in: on the meta device with the Materialiser
    that makes each layer real (RoundPipe's ``materialise``), where every layer initialises itself and
    neither model.weights nor LoRA needs the whole model first; else built as build_model does, and None."""
    return _build(cfg, dtype, None, vocab_size, stream=True)


def _build(cfg: DictConfig, dtype: torch.dtype, device: Any, vocab_size: Optional[int], stream: bool) -> tuple[nn.Sequential, Optional["Materialiser"]]:
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    weights = model_cfg.pop("weights", None)
    lora = model_cfg.pop("lora", None)
    if model_kind(cfg.model) == LM and model_cfg.get("vocab_size") is None:
        model_cfg["vocab_size"] = vocab_size
    # The registry by name, never Hydra's instantiate: a config read back from a file is data (stored_config.py).
    if model_cfg.pop("_target_", BUILDER) != BUILDER:
        raise ConfigError(f"model._target_={cfg.model.get('_target_')!r}: models are built by {BUILDER}; leave model._target_ out")
    layered = device is None and not model_cfg.get("path")  # model=hf loads itself a tensor at a time
    streamed = stream and device is None and weights is None and not (lora or {}).get("rank")
    maker = None
    try:
        model = build_registered(**model_cfg, dtype=dtype, device="meta" if layered or streamed else device)
        if streamed and model_cfg.get("path") and layer_by_layer(model, init=False):  # model=hf: read a layer at a time
            maker = Materialiser(model, init=False, fill=layer_loader(model, model_cfg["path"]))
        elif streamed and layered and layer_by_layer(model):
            maker = Materialiser(model)
        elif streamed:  # a model the Materialiser cannot take: built as before
            model = build_registered(**model_cfg, dtype=dtype, device=device)
        elif layered:  # meta tensors draw no random numbers: a model materialise() cannot take is built as before
            model = (materialise(model, init=weights is None) if layer_by_layer(model)
                     else build_registered(**model_cfg, dtype=dtype, device=device))
    except Exception as err:  # the builders raise ValueError for inconsistent shapes
        cause = err.__cause__ or err
        if isinstance(cause, HFModelError):  # names the file and field itself
            raise ConfigError(one_line(cause)) from err
        raise ConfigError(f"model={cfg.model.name}: {one_line(cause)}: fix the model.* values") from err
    limit, seq_len = getattr(model[0], "max_seq_len", None), cfg.data.get("seq_len") or cfg.data.get("max_seq_len")
    if cfg.model.get("max_seq_len", 0) is None and limit is not None and seq_len is not None and seq_len > limit:
        key = "data.seq_len" if cfg.data.get("seq_len") else "data.max_seq_len"
        raise ConfigError(f"{key}={seq_len} is longer than {cfg.model.path}'s {limit} positions: "
                          f"lower {key}, or set model.max_seq_len to train longer anyway")
    if weights is not None and (checkpoint := run_checkpoint(weights)) is not None:
        load_run_weights(model, checkpoint)  # a finished run seeds this one (checked on meta too: preflight)
    elif weights is not None and device != "meta":
        try:
            load_weights(model, weights)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            raise ConfigError(f"model.weights={weights} cannot be loaded ({one_line(err)}): point it at a checkpoint of this model") from err
    return with_lora(model, lora), maker


def init_device() -> torch.device:
    """Where a preset's layers are initialised: the GPU when there is one (seconds for 8 B parameters,
    where the CPU's one-threaded random draws took minutes), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def layer_by_layer(model: nn.Sequential, init: bool = True) -> bool:
    """Whether materialise() can make ``model`` real: every layer initialises itself (``reset_parameters``;
    not needed where a file fills every tensor, ``init=False``) and holds no buffers (to_empty would leave
    them undefined)."""
    return all((hasattr(layer, "reset_parameters") or not init) and next(layer.buffers(), None) is None for layer in model)


class Materialiser:
    """Makes a model built on the meta device real one layer at a time: ``maker(i)`` allocates layer
    ``i`` on ``device`` (init_device()) and initialises it there by its ``reset_parameters``; it stays
    there (the engine copies it where it will live). ``init=False`` (model.weights will overwrite every
    tensor): allocated on the host, not initialised. Called for every layer in order, from the same
    generator, it draws what the builder would: the weights equal building the whole model on ``device``
    directly, bit for bit. A parameter a layer shares with an earlier one (a tied head) stays the
    earlier layer's: a meta stand-in takes its place while the layer is made real.
    Only for models that pass layer_by_layer()."""

    def __init__(self, model: nn.Sequential, device: Optional[torch.device] = None, init: bool = True,
                 fill: Optional[Callable[[int], None]] = None) -> None:
        """``fill(i)``: writes layer ``i``'s tensors once it is allocated (model=hf reads them from its folder)."""
        self.model, self.init, self.fill = model, init, fill
        self.device = (device or init_device()) if init else torch.device("cpu")
        self.tied = [_tied_to_earlier(model, layer) for layer in model]  # found while every layer is on meta

    def __call__(self, index: int) -> None:
        layer = self.model[index]
        for name, shared in self.tied[index]:  # a stand-in, so making this layer real never touches the earlier layer's tensor
            _set(layer, name, nn.Parameter(torch.empty_like(shared(), device="meta")))
        with torch.no_grad():
            layer.to_empty(device=self.device)
            if self.init:
                layer.reset_parameters()
        for name, shared in self.tied[index]:  # one Parameter in both places again, the earlier layer's (which initialised it)
            _set(layer, name, shared())
        if self.fill is not None:
            self.fill(index)


def materialise(model: nn.Sequential, device: Optional[torch.device] = None, init: bool = True) -> nn.Sequential:
    """A model built on the meta device, made real one layer at a time (Materialiser) and each layer
    moved to the host, so a GPU holds one layer at a time: on the CPU the weights earlier versions
    built; on a GPU those of ``rptrain.models.build_model(..., device="cuda")``, as bench/llm.py builds,
    from CUDA's generator seeded by trainer.seed. Only for models that pass layer_by_layer()."""
    maker = Materialiser(model, device, init)
    for i, layer in enumerate(model):
        maker(i)
        layer.to("cpu")
    return model


def _set(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, value)


def _tied_to_earlier(model: nn.Sequential, layer: nn.Module) -> list[tuple[str, Any]]:
    """(name in ``layer``, getter of the earlier layer's parameter) for each parameter ``layer``
    shares with an earlier layer (a tied head)."""
    index = list(model).index(layer)
    earlier = {id(p): (i, n) for i in range(index) for n, p in model[i].named_parameters()}
    found = []
    for name, p in layer.named_parameters(remove_duplicate=False):
        if id(p) in earlier:
            i, n = earlier[id(p)]
            found.append((name, lambda i=i, n=n: model[i].get_parameter(n)))
    return found


def fingerprint(model_name: str, model: nn.Module) -> dict:
    """What a checkpoint must match: names and shapes of every parameter and buffer."""
    entries = [f"{k}:{tuple(t.shape)}" for k, t in model.state_dict().items()]
    return {
        "model": model_name,
        "params": sum(p.numel() for p in model.parameters()),
        "shapes": hashlib.sha1("\n".join(entries).encode()).hexdigest()[:16],
    }

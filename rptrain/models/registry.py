"""Name -> builder registry, in the spirit of timm's `create_model`.

A builder is any function returning an `nn.Sequential`; keyword arguments passed
to `build_model` go straight to it, so each family decides what it can override.
"""

from typing import Callable

from torch import nn

Builder = Callable[..., nn.Sequential]
_REGISTRY: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator: make `fn` buildable as `build_model(name, **overrides)`."""

    def decorator(fn: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def build_model(name: str, **overrides) -> nn.Sequential:
    """Build a registered model; `overrides` are forwarded to its builder."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(list_models())}")
    return _REGISTRY[name](**overrides)


def list_models() -> list[str]:
    return sorted(_REGISTRY)

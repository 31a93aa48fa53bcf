"""The engine (and wrap_model's wrapper) as the wrapped model's stand-in: attributes it lacks are read,
written and deleted on the wrapped model (the original library's behaviour)."""
from __future__ import annotations

from typing import Any

from torch import nn


class ForwardsAttributes(nn.Module):
    """Mixed into RoundPipe and WrappedModel, which set ``_initialized`` once their own attributes exist and
    keep the wrapped model as ``model``."""

    def __getattr__(self, name: str) -> Any:
        """Attributes RoundPipe lacks are read from the wrapped model."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None:
                raise
            return getattr(model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """After construction, attributes RoundPipe does not have itself are written to the wrapped model."""
        if self.__dict__.get("_initialized") and not self._owns(name):
            setattr(self.model, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_initialized") and not self._owns(name):
            delattr(self.model, name)
        else:
            super().__delattr__(name)

    def _owns(self, name: str) -> bool:
        return name in self.__dict__ or name in self._modules or name in self._parameters or name in self._buffers or hasattr(type(self), name)

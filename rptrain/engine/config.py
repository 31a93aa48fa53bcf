"""RoundPipeRunConfig: per-model defaults that a single call can override, validated at the boundary."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

RECOMPUTE_GRAINS = ("stage", "layer")


@dataclass
class RoundPipeRunConfig:
    """How one call runs. Every field is optional: ``None`` means "inherit".

    Resolution order: call-level config, then the model-level config given to ``RoundPipe``,
    then the built-in defaults below.

    - ``num_microbatch``: microbatches per call (default: the engine's GPUs + 1; 1 on the CPU fallback:
      ``default_microbatches``).
    - ``requires_grad``: whether ``model(...)`` records a graph so that ``.backward()`` on its output
      runs the pipeline backward (default: ``torch.is_grad_enabled()`` at call time).
    - ``output_device``: where outputs and the returned loss go (default: CPU).
    - ``preserve_rng_state``: replay each microbatch's RNG state when recomputing, so Dropout masks
      match the forward (default: True).
    - ``recompute_grain``: ``"stage"`` keeps one input per backward stage and recomputes the stage;
      ``"layer"`` keeps every layer's input and recomputes one layer at a time (less GPU memory).
    - ``split_input``: ``f(args: tuple, kwargs: dict, n: int) -> (args_list, kwargs_list)`` or
      ``(args_spec, kwargs_spec)`` of chunk specs (batching.py), either None for automatic.
    - ``split_label``: ``f(label, n: int) -> list[label]`` or a chunk spec structure.
    - ``merge_output``: ``f(outputs: list) -> output``, a spec structure (``TensorChunkSpec``,
      ``_Replicate``, ``_CustomReducer``), True (automatic) or False (per-microbatch ``PackedData``).
    - ``execute_plan``: an ``ExecutePlan`` (or the original's ``ModelExecutePlan``) fixing the stage
      boundaries instead of the planner's.
    """

    num_microbatch: Optional[int] = None
    requires_grad: Optional[bool] = None
    output_device: Optional[Any] = None
    preserve_rng_state: Optional[bool] = None
    recompute_grain: Optional[str] = None
    split_input: Optional[Any] = None
    split_label: Optional[Any] = None
    merge_output: Optional[Any] = None
    execute_plan: Optional[Any] = None

    def __post_init__(self) -> None:
        n = self.num_microbatch
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"RoundPipeRunConfig.num_microbatch must be an integer >= 1, got {n!r}")
        for name in ("requires_grad", "preserve_rng_state"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"RoundPipeRunConfig.{name} must be True, False or None, got {value!r}")
        if self.recompute_grain is not None and self.recompute_grain not in RECOMPUTE_GRAINS:
            raise ValueError(
                f"RoundPipeRunConfig.recompute_grain must be one of {RECOMPUTE_GRAINS}, got {self.recompute_grain!r}"
            )
        if self.output_device is not None:
            try:
                self.output_device = torch.device(self.output_device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(
                    f"RoundPipeRunConfig.output_device must name a torch device, got {self.output_device!r}"
                ) from e
        split = self.split_input
        if split is not None and not callable(split) and not (isinstance(split, (tuple, list)) and len(split) == 2):
            raise ValueError(f"RoundPipeRunConfig.split_input must be callable or (args_spec, kwargs_spec), got {type(split).__name__}")
        if self.execute_plan is not None:
            from .model_plan import ModelExecutePlan
            from .plan import ExecutePlan

            if not isinstance(self.execute_plan, (ExecutePlan, ModelExecutePlan)):
                raise ValueError(
                    f"RoundPipeRunConfig.execute_plan must be an ExecutePlan or ModelExecutePlan, got {type(self.execute_plan).__name__}"
                )

    def override(self, other: Optional["RoundPipeRunConfig"]) -> "RoundPipeRunConfig":
        """A copy of ``self`` with every field that ``other`` sets replaced."""
        if other is None:
            return self
        if not isinstance(other, RoundPipeRunConfig):
            raise TypeError(f"run_config must be a RoundPipeRunConfig, got {type(other).__name__}")
        changes = {f.name: getattr(other, f.name) for f in dataclasses.fields(other) if getattr(other, f.name) is not None}
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ResolvedRunConfig:
    """A run config with every default filled in; what the executor reads."""

    num_microbatch: int
    requires_grad: bool
    output_device: torch.device
    preserve_rng_state: bool
    recompute_grain: str
    split_input: Optional[Any]
    split_label: Optional[Any]
    merge_output: Optional[Any]
    execute_plan: Optional[Any]


def default_microbatches_for(devices: Any = None) -> int:
    """``default_microbatches`` of an engine made with ``RoundPipe(..., devices=devices)``, without
    making it (device.py's ``make_devices`` reads ``devices`` the same way)."""
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return default_microbatches(count, True) if count else 1
    items = [devices] if isinstance(devices, (str, torch.device)) else list(devices)
    cuda = any(getattr(d, "is_cuda", False) if not isinstance(d, (str, torch.device)) else torch.device(d).type == "cuda" for d in items)
    return default_microbatches(len(items), cuda)


def default_microbatches(num_devices: int, cuda: bool) -> int:
    """Microbatches per call when the run config sets none: one more than the engine's GPUs, so one
    stage's upload overlaps the others' compute; 1 on the CPU, where microbatches overlap nothing."""
    return num_devices + 1 if cuda else 1


def resolve(config: RoundPipeRunConfig, default_microbatches: int) -> ResolvedRunConfig:
    return ResolvedRunConfig(
        num_microbatch=config.num_microbatch if config.num_microbatch is not None else default_microbatches,
        requires_grad=config.requires_grad if config.requires_grad is not None else torch.is_grad_enabled(),
        output_device=config.output_device if config.output_device is not None else torch.device("cpu"),
        preserve_rng_state=True if config.preserve_rng_state is None else config.preserve_rng_state,
        recompute_grain=config.recompute_grain or "stage",
        split_input=config.split_input,
        split_label=config.split_label,
        merge_output=config.merge_output,
        execute_plan=config.execute_plan,
    )

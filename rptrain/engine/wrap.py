"""``wrap_model``: pipeline the heavy parts of a model that is not one ``nn.Sequential``.

The model keeps its own ``forward`` (the light glue: masks, rotary tables, a final norm) and runs
it on the host; its heavy children become ``RoundPipe`` engines in place, found top down:

- an ``nn.Sequential`` child: one engine, a pipeline layer per element;
- an ``nn.ModuleList`` child (a transformer's decoder stack): an engine per element; all but the
  last return per-microbatch ``PackedData`` that the next one takes as it is, so the stack's
  microbatches never merge on the host between layers;
- any other child whose own parameters reach ``lower_threshold`` bytes (an embedding, an LM head):
  one engine around it; otherwise its children are searched the same way.

The engines share one optimizer thread, and ``step`` runs the step function once with every
engine's gradients bound (``OptimizerCtx`` and ``parameters()`` give all master parameters, the
glue's own parameters included). They also share one host budget (``max_host_memory``, default:
fit.py's): each engine is fitted against what the engines before it left, so a decoder stack whose
layers each fit alone but not together is refused with one line instead of killed by the system.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Container, Iterable, Iterator, Optional

import torch
from torch import nn

from .batching import merge_outputs, split_inputs, split_label
from .config import RoundPipeRunConfig
from .fit import DoesNotFit, host_budget_left
from .forwarding import ForwardsAttributes
from .optimizer_ctx import OptimizerCtx, in_optimizer_ctx
from .placement import HOST, fmt_bytes
from .roundpipe import RoundPipe

LOWER_THRESHOLD = 16 * 1024  # bytes of a module's own parameters that make it worth an engine


def wrap_model(model: nn.Module, model_run_config: Optional[RoundPipeRunConfig] = None, lower_threshold: int = LOWER_THRESHOLD,
               skip_modules: Container[nn.Module] = (), **roundpipe_kwargs: Any) -> nn.Module:
    """A ``RoundPipe`` for an ``nn.Sequential``, else a ``WrappedModel`` (see the module doc).
    ``roundpipe_kwargs`` go to every ``RoundPipe``; ``use_sequential_preset`` is accepted and ignored."""
    roundpipe_kwargs.pop("use_sequential_preset", None)
    config = model_run_config or RoundPipeRunConfig()
    make = functools.partial(RoundPipe, model_run_config=config, **roundpipe_kwargs)
    if isinstance(model, nn.Sequential):
        return make(model)
    engines: list[tuple[str, RoundPipe]] = []
    claimed = _Claims(host_budget_left(roundpipe_kwargs.pop("max_host_memory", None))[0])
    _wrap_children(model, "", claimed.checked(make), config, lower_threshold, skip_modules, engines)
    return WrappedModel(model, engines, config)


wrap_model_to_roundpipe = wrap_model  # the original library's name


class _Claims:
    """Which engine took each parameter, checked before the next engine is built: an engine may move
    the tensors it owns (its GPU share), so a weight tied into a later engine must be refused first."""

    def __init__(self, host_budget: int) -> None:
        self.owner: dict[int, str] = {}
        self.host_budget = self.host_left = host_budget  # the shared host budget, and what the engines built so far left

    def checked(self, make: Callable) -> Callable:
        """``make`` taking ``(prefix, model, **kwargs)``: claims the model's parameters, then builds the
        engine against the host budget left."""
        def build(prefix: str, model: nn.Module, **kwargs: Any) -> RoundPipe:
            for name, p in model.named_parameters():
                first = self.owner.setdefault(id(p), prefix)
                if first != prefix:
                    raise ValueError(f"wrap_model: {prefix}{name} is tied to a parameter of {first.rstrip('.')}: engines "
                                     "cannot share weights; untie them or build one nn.Sequential holding both users")
            try:
                engine = make(model, max_host_memory=max(self.host_left, 0), **kwargs)
            except DoesNotFit as error:
                held = fmt_bytes(self.host_budget - self.host_left)
                raise DoesNotFit(f"wrap_model: {prefix.rstrip('.')}: the engines before it hold {held} of the "
                                 f"{fmt_bytes(self.host_budget)} host budget; {error}", error.placement) from None
            self.host_left -= engine.placement.total(HOST)
            return engine
        return build


def _own_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def _wrap_children(module: nn.Module, prefix: str, make: Callable, config: RoundPipeRunConfig, threshold: int,
                   skip: Container[nn.Module], engines: list) -> None:
    for name, child in list(module.named_children()):
        path = f"{prefix}{name}"
        if child in skip or not any(True for _ in child.parameters()):
            continue
        if isinstance(child, nn.Sequential):
            engine = make(f"{path}.", child)
            engines.append((f"{path}.", engine))
        elif isinstance(child, nn.ModuleList):
            last = len(child) - 1
            for i, element in enumerate(child):
                packed = RoundPipeRunConfig(merge_output=False) if i < last else None
                engine = make(f"{path}.{i}.", element, model_run_config=config.override(packed))
                engines.append((f"{path}.{i}.", engine))
                child[i] = engine
            continue
        elif _own_bytes(child) >= threshold:
            engine = make(f"{path}.", child)  # one layer (RoundPipe wraps a module that is not a Sequential whole)
            engines.append((f"{path}.", engine))
        else:
            _wrap_children(child, f"{path}.", make, config, threshold, skip, engines)
            continue
        setattr(module, name, engine)


class WrappedModel(ForwardsAttributes):
    """A model with ``RoundPipe`` engines in place of its heavy children (``wrap_model``)."""

    def __init__(self, model: nn.Module, engines: list[tuple[str, RoundPipe]], run_config: Optional[RoundPipeRunConfig] = None):
        super().__init__()
        self.model = model
        self._run_config = run_config or RoundPipeRunConfig()
        self._engines = engines
        shared = engines[0][1]._versions.thread if engines else None
        for _, engine in engines[1:]:
            engine._versions.thread = shared
        owner = {id(p): prefix.rstrip(".") for prefix, engine in engines for p in engine.model.parameters()}  # ties between engines: _Claims
        for name, p in _glue_parameters(model, ""):
            if id(p) in owner:
                raise ValueError(f"wrap_model: {name} is tied to a parameter of {owner[id(p)]}: the host glue cannot share an "
                                 "engine's weights; untie them or pass the engine's module in skip_modules")
        self._glue = list({id(p): (n, p) for n, p in reversed(list(_glue_parameters(model, "")))}.values())[::-1]
        self._initialized = True  # from here on, attributes WrappedModel lacks are the model's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._raise_errors()
        return self.model(*args, **kwargs)

    def forward_backward(self, input_args: Any = (), input_kwargs: Optional[dict] = None, label: Any = None,
                         loss_fn: Callable = lambda outputs, label: outputs, return_outputs: bool = False,
                         run_config: Optional[RoundPipeRunConfig] = None) -> Any:
        """The original library's semantics: the batch is split into ``num_microbatch`` microbatches
        (the run config's, else the engines' default), and each runs ``loss_fn(model(...), label)``
        and its backward; returns the sum of the microbatch losses (a list of sums when ``loss_fn``
        returns several). So ``lambda out, _: out.loss / num_microbatch`` gives a Hugging Face model's
        batch loss. The microbatches run one after another, each whole through every engine."""
        self._raise_errors()
        cfg = self._run_config.override(run_config)
        n = cfg.num_microbatch or (self._engines[0][1]._prepare.default_microbatches if self._engines else 1)
        args = (input_args,) if isinstance(input_args, torch.Tensor) else tuple(input_args)
        micro = split_inputs(args, dict(input_kwargs or {}), n, cfg.split_input)
        labels = split_label(label, n, cfg.split_label)
        losses, outputs = [], []
        with self._one_microbatch_each():
            for (a, k), y in zip(micro, labels):
                out = self(*a, **k)
                loss = loss_fn(out, y)
                parts = [loss] if isinstance(loss, torch.Tensor) else list(loss)
                torch.autograd.backward([t for t in parts if t.requires_grad])
                losses.append([t.detach() for t in parts])
                outputs.append(out)
        total = [torch.stack(column).sum() for column in zip(*losses)]
        loss = total[0] if isinstance(loss, torch.Tensor) else total
        return (loss, merge_outputs(outputs, cfg.merge_output)) if return_outputs else loss

    @contextlib.contextmanager
    def _one_microbatch_each(self) -> Iterator[None]:
        """The engines run each microbatch of ``forward_backward`` whole (they would split it again)."""
        one = RoundPipeRunConfig(num_microbatch=1)
        for _, engine in self._engines:
            engine._prepare.enclosing = one
        try:
            yield
        finally:
            for _, engine in self._engines:
                engine._prepare.enclosing = None

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's names; inside ``OptimizerCtx`` (and step functions) the master parameters."""
        master = in_optimizer_ctx()
        for engine_prefix, engine in self._engines:
            for name, p in (engine.optim_named_parameters() if master else engine.model.named_parameters()):
                yield prefix + engine_prefix + name, p
        for name, p in self._glue:
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        with OptimizerCtx():
            return iter(list(self.parameters()))

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """``step_fn`` once, on the shared optimizer thread, with every engine's gradients bound.
        With trainable glue parameters it waits (the glue runs on the host, in place)."""
        self._raise_errors()
        engines = [e._versions for _, e in self._engines]
        # One engine with a single version of the weights waits for the shared step anyway; the others then use
        # its result too, rather than train on a mix of fresh and one-step-stale weights.
        is_async = is_async and not any(p.requires_grad for _, p in self._glue) and not any(e.host.single_version for e in engines)
        closed = [e.close_window() for e in engines]
        scalers: dict = {}
        for _, window_scalers in closed:
            for scaler, (scale, found_inf) in window_scalers.items():
                scalers[scaler] = (scale, found_inf or scalers.get(scaler, (scale, False))[1])
        versions = [e.claim() for e in engines]
        task = functools.partial(step_fn, *args, **kwargs)
        for engine, (buffer, _), version in reversed(list(zip(engines, closed, versions))):
            task = functools.partial(engine.run_step, task, buffer, scalers, dict(engine.executor.ended), None, version)
        ticket = engines[0].thread.submit(task)
        for engine, version in zip(engines, versions):
            engine.tickets[version] = ticket
        _all_then_raise(functools.partial(e.stepped, v, b, is_async) for e, (b, _), v in zip(engines, closed, versions))

    def explain(self, *example_inputs: Any, **kwargs: Any) -> str:
        """Every engine's plan and actions (RoundPipe.explain); their inputs come from the glue, so no shapes."""
        return "\n\n".join(f"{prefix.rstrip('.') or 'model'}:\n{engine.explain()}" for prefix, engine in self._engines)

    def synchronize(self) -> None:
        for _, engine in self._engines:
            engine.synchronize()

    def close(self) -> None:
        _all_then_raise(engine.close for _, engine in self._engines)

    def _raise_errors(self) -> None:
        for _, engine in self._engines:
            engine._versions.check()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """Master weights and persistent buffers under the model's names."""
        out = {}
        for engine_prefix, engine in self._engines:
            out.update({engine_prefix + k: v for k, v in engine.state_dict().items()})
        out.update({name: p.detach() for name, p in self._glue})
        out.update(_glue_buffers(self.model, ""))
        return out


def _glue_buffers(module: nn.Module, prefix: str) -> Iterator[tuple[str, Any]]:
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, b.detach()
    for name, child in module._modules.items():
        if child is not None and not isinstance(child, RoundPipe):
            yield from _glue_buffers(child, f"{prefix}{name}.")


def _glue_parameters(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in module._parameters.items():
        if p is not None:
            yield prefix + name, p
    for name, child in module._modules.items():
        if child is not None and not isinstance(child, RoundPipe):
            yield from _glue_parameters(child, f"{prefix}{name}.")


def _all_then_raise(calls: Iterable[Callable[[], Any]]) -> None:
    """Run every call (each engine's bookkeeping), then raise the first error."""
    errors = []
    for call in calls:
        try:
            call()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]

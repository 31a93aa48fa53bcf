"""CPU optimizers for the master weights (create them inside ``OptimizerCtx``): the original
library's ``roundpipe.optim`` set under its names, each a subclass of the torch optimizer of the same
name with its constructor arguments, state dict and behaviour.

torch.optim steps one parameter tensor at a time: for a ResNet's hundred-odd small tensors most
calls are too small to spread over the cores. The engine keeps master weights and gradients in flat
buffers, so here each update runs once per contiguous run of parameters instead, its state in flat
buffers too, viewed per parameter in ``optimizer.state`` so state dicts look exactly like torch's.
Adam, AdamW, SGD and Adagrad call torch's fused kernels on the runs; Adadelta, Adamax, ASGD, NAdam,
RAdam, RMSprop and Rprop a compiled one-pass update (kernels.py); Adafactor, whose update needs whole
tensors, a compiled per-parameter update (adafactor.py). Parameters on a GPU (the engine's GPU share)
get the same treatment there, stepped first. Anything the flat path does not cover (amsgrad,
differentiable, capturable, complex or non-contiguous parameters, ...) takes torch's own step.

Each optimizer's per-parameter state is declared as data (``state_specs``, state_spec.py), so its
memory can be counted before it is allocated.

Low-memory state (issue 29; docs/low-memory-state.md): Adam/AdamW take ``state_dtype`` fp32 | bf16 | int8
moments and step a bf16 master with stochastic rounding (lowbit.py formats, adam_lowp.py / cpu_kernel.py
steps); an optimizer class states its memory for the engine's fit check (state.py: ``state_memory``).
"""
from .adafactor import Adafactor
from .adam import Adam, AdamW
from .adam_variants import Adamax, NAdam, RAdam
from .adaptive import Adadelta, Adagrad, RMSprop, Rprop
from .sgd import ASGD, SGD
from .state_spec import StateSpec, state_bytes

__all__ = [
    "ASGD", "SGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
    "Rprop", "StateSpec", "state_bytes",
]

"""CPU optimizers for the master weights (create them inside ``OptimizerCtx``).

They are PyTorch's Adam and AdamW, run with PyTorch's fused CPU kernel (``Adam`` is the name
the original library's ``roundpipe.optim`` exports; any other torch optimizer works on the master
weights too, at torch's own speed). torch.optim calls that
kernel once per parameter tensor: for a ResNet's hundred-odd small tensors most calls are too
small to spread over the cores. The engine keeps master weights and gradients in flat buffers, so
here the kernel runs once per contiguous run of parameters instead: the moments live in flat
buffers too, viewed per parameter in ``optimizer.state`` so state dicts look exactly like
torch's. Parameters on a GPU (the engine's GPU share) get the same treatment there, stepped first.
Anything the flat path does not cover (amsgrad, maximize, non-contiguous parameters, ...) takes
torch's own step.

Low-memory state (issue 29; docs/low-memory-state.md): ``state_dtype`` fp32 | bf16 | int8 moments and a
bf16 master stepped with stochastic rounding (lowbit.py formats, adam_lowp.py / cpu_kernel.py steps);
every optimizer class may declare its state per parameter for the engine's fit check (state.py).
"""
from .adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]

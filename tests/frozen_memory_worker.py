"""Run by tests/test_engine_frozen.py in a fresh process (earlier tests' freed memory stays out of
the measurement): the anonymous resident memory (what the process allocated, as the kernel counts
it; library code pages excluded) that ~335 M frozen bf16 parameters cost, from before the model is
built to after it is wrapped and trained a step. A tiny run first pays the one-time costs of the
libraries (torch.optim's first use alone allocates ~75 MB of Python modules)."""
import json

import torch
from torch import nn

from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.optim import Adam

WIDTH, LAYERS = 8192, 5


def anon_kib(field: str = "RssAnon") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def train_step(model: nn.Sequential, width: int) -> RoundPipe:
    # On the CPU: pinned memory (a GPU engine's) is accounted differently by the kernel.
    engine = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=1), devices=["cpu"])
    with OptimizerCtx():
        opt = Adam([p for p in engine.parameters() if p.requires_grad], lr=1e-3)
    x, y = torch.randn(2, width, dtype=torch.bfloat16), torch.tensor([0, 1])
    engine.forward_backward(input_args=(x,), label=y, loss_fn=lambda out, t: nn.functional.cross_entropy(out.float(), t))
    engine.step(lambda: (opt.step(), opt.zero_grad()))
    engine.synchronize()
    engine.opt = opt
    return engine


def frozen_model(width: int, layers: int) -> nn.Sequential:
    frozen = []
    for _ in range(layers):  # skip nn.Linear's init: filling commits the pages just as well
        layer = nn.Linear(width, width, bias=False, dtype=torch.bfloat16, device="meta").to_empty(device="cpu")
        layer.weight.requires_grad_(False).fill_(1.0 / width)
        frozen.append(layer)
    return nn.Sequential(*frozen, nn.Linear(width, 4, dtype=torch.bfloat16))


def main() -> None:
    train_step(frozen_model(64, 2), 64).close()
    before, before_rss = anon_kib(), anon_kib("VmRSS")
    engine = train_step(frozen_model(WIDTH, LAYERS), WIDTH)
    after = anon_kib()
    frozen_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters() if not p.requires_grad)
    print(json.dumps({
        "frozen_bytes": frozen_bytes, "largest_bytes": WIDTH * WIDTH * 2,
        "delta": (after - before) * 1024, "peak_delta": (anon_kib("VmHWM") - before_rss) * 1024,  # resident set: includes code pages
        "report": engine.memory_report(engine.opt),
    }))


if __name__ == "__main__":
    main()

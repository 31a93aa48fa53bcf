"""Issue 29: how many copies of the weights a GPU keeps resident, with the master in bf16 (or fp32).

Counts, after each call and each step (asynchronous, then synchronous), the elements of the resident
store's upload slots (one per version kept), of its live copy (what jobs read), and of the GPU share's
master, against the model's parameters. On the CPU it runs on a simulated GPU (engine/simulated.py),
which takes the same code paths; with --device cuda on the real one.

    python3 bench/resident_copies.py --device cuda --master bf16     # seconds
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit, parser  # noqa: E402

from rptrain import RoundPipe  # noqa: E402
from rptrain.models import build_model  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--master", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    if args.tiny:
        args.dim, args.layers = 64, 2
    if args.device == "cuda":
        devices = None
    else:
        from rptrain.engine.simulated import SimulatedDevice

        devices = [SimulatedDevice(0, 8 << 30)]
    torch.manual_seed(0)
    model = build_model("llama_tiny", vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=2, dtype=torch.bfloat16)
    params = sum(q.numel() for q in model.parameters())
    master = torch.bfloat16 if args.master == "bf16" else torch.float32
    engine = RoundPipe(model, master, devices=devices, keep_user_weights=False)
    opt = torch.optim.SGD(list(engine.optim_parameters()), lr=1e-3)
    ids = torch.randint(0, 1024, (2, 64))
    store = engine._executor.store
    host = engine._host

    def record(after: str, is_async: bool) -> None:
        engine._versions.wait_all()  # the step's staging is done: count what it left
        resident = getattr(store, "resident", {}).get(0)
        count = lambda st: sum(t.numel() for _, t in st.pieces) if st is not None else 0  # noqa: E731
        slots = sorted(resident.staged) if resident else []
        emit(bench="resident_copies", device=args.device, master=args.master, after=after, is_async=is_async, params=params,
             gpu_layers=engine.placement.gpu_layers, staged_versions=slots,
             staged=sum(count(s) for s in resident.staged.values()) if resident else 0,
             live=count(resident.live) if resident else 0,
             gpu_master=sum(t.numel() for t in host.gpu.master.values()) if host.gpu is not None else 0)

    for is_async in (True, True, True, False, False, False):
        engine.forward_backward(input_args=((ids, ids),))
        record("call", is_async)
        engine.step(opt.step, is_async=is_async)
        record("step", is_async)
    engine.close()


if __name__ == "__main__":
    main()

"""Packed causal attention, forward + backward: which kernel should packed rows use? (issue 17)

Rows of `--seq` tokens, `--batch` of them, filled with documents whose lengths follow a distribution
(`uniform` 128-1024, `long` ~2000 = uniform 1536-2560, `one`: a single document per row, plain causal).
Every token attends to the earlier tokens of its own document. Implementations:

  sdpa_mask     rptrain's default path (model.attention=sdpa): SDPA with a dense (B, 1, T, T) boolean
                mask, built per call as the model does (kv heads repeated: masked SDPA takes no GQA)
  flex          compiled FlexAttention (rptrain's model.attention=flex kernel), block mask built per call
  flex_prebuilt the same kernel with the block mask built once outside the clock; `mask_ms` is the build alone
  varlen        torch.nn.attention.varlen.varlen_attn on (B*T, H, D) with cu_seqlens (where torch has it
                and the device runs it); cu_seqlens built outside the clock
  causal        SDPA is_causal over the whole row: wrong for packing (documents see each other), the bound

Then one whole rptrain DecoderBlock forward + backward per model.attention (sdpa, flex) on the same rows,
segments given afresh each call (so flex builds its block mask in every call, as a batch's first layer does).
One JSON line per measurement, `ms` = fwd+bwd milliseconds (`pass: fwd` where a path has no backward on
this device: eager FlexAttention on the CPU). `--tiny`: CI size on the CPU, measures nothing useful.
"""
from __future__ import annotations

import dataclasses
import inspect
import time

import torch

from common import emit, parser, sync, time_steps
from rptrain.models.attention import causal_attention, flex_attention, flex_block_mask, positions, runs
from rptrain.models.decoder import DecoderBlock
from rptrain.models.llama import decoder_config, llama_config

DISTS = {"uniform": (128, 1024), "long": (1536, 2560), "one": None}
IMPLS = ["sdpa_mask", "flex", "flex_prebuilt", "varlen", "causal"]


def segments(B: int, T: int, dist: str, scale: float, gen: torch.Generator) -> torch.Tensor:
    """(B, T) document ids: each row filled with documents drawn from the distribution, the last cut at T."""
    if DISTS[dist] is None:
        return torch.zeros(B, T, dtype=torch.long)
    lo, hi = (max(1, int(n * scale)) for n in DISTS[dist])
    rows = []
    for _ in range(B):
        ids, doc = [], 0
        while len(ids) < T:
            ids += [doc] * int(torch.randint(lo, hi + 1, (1,), generator=gen))
            doc += 1
        rows.append(ids[:T])
    return torch.tensor(rows)


def cu_seqlens(seg: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative document starts over the flattened (B*T) tokens, and the longest document."""
    starts = (positions(seg) == 0).flatten().nonzero().flatten()
    idx = torch.cat([starts, torch.tensor([seg.numel()], device=seg.device)])
    return idx.to(torch.int32), int((idx[1:] - idx[:-1]).max())


def varlen_fn():
    """varlen_attn for (B*T, H, D) inputs, adapted to this torch's signature (is_causal in 2.10,
    window_size later; enable_gqa later still: without it the kv heads are repeated)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = dict(window_size=(-1, 0)) if "window_size" in params else dict(is_causal=True)

    def run(q, k, v, cu, longest):
        if "enable_gqa" in params:
            causal["enable_gqa"] = q.size(1) != k.size(1)
        elif q.size(1) != k.size(1):
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, longest, longest, **causal)
    return run


def attention_impl(impl: str, seg: torch.Tensor, device: str):
    """A function (q, k, v) -> out on (B, T, H, D) tensors, or a reason it cannot run here."""
    B, T = seg.shape
    compiled = device == "cuda"
    if impl == "sdpa_mask":
        return lambda q, k, v: causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), segments=seg)
    if impl == "causal":
        return lambda q, k, v: causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if impl == "flex":
        return lambda q, k, v: flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), compiled=compiled,
                                              block_mask=flex_block_mask(B, T, device, seg))
    if impl == "flex_prebuilt":
        mask = flex_block_mask(B, T, device, seg)
        return lambda q, k, v: flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), compiled=compiled, block_mask=mask)
    fn = varlen_fn()
    if fn is None:
        return "torch.nn.attention.varlen is missing in this torch"
    if device != "cuda":
        return "varlen_attn runs on CUDA only"
    cu, longest = cu_seqlens(seg)
    return lambda q, k, v: fn(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, longest)


def fwd_bwd(fn, inputs, backward: bool):
    def step(_):
        if not backward:
            return fn(*(t.detach() for t in inputs))  # FlexAttention checks requires_grad, not the grad mode
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        return out.detach()
    return step


def measure(fn, inputs, args, expected: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """First call (compiles) timed apart and its output compared with `expected` (relative error);
    then ms per fwd+bwd, or per forward where backward is missing here."""
    backward = True
    t = time.perf_counter()
    try:
        out = fwd_bwd(fn, inputs, backward)(0)
    except NotImplementedError as e:  # FlexAttention has no CPU backward
        if "backward" not in str(e):
            raise
        backward = False
        out = fwd_bwd(fn, inputs, backward)(0)
    sync(args.device)
    first = time.perf_counter() - t
    out = out.reshape(inputs[0].shape[:2] + (-1,)).float()
    expected = out if expected is None else expected
    s = time_steps(fwd_bwd(fn, inputs, backward), args.steps, args.warmup, args.device)
    return dict(ms=round(s * 1e3, 3), first_call_s=round(first, 2), rel_err=float((out - expected).norm() / expected.norm()),
                **({} if backward else {"pass": "fwd"})), out


def block_mask_ms(seg: torch.Tensor, args) -> float:
    B, T = seg.shape
    return time_steps(lambda _: flex_block_mask(B, T, args.device, seg), args.steps, 1, args.device) * 1e3


def run_attention(args, name: str, cfg, dist: str, seg: torch.Tensor, dtype) -> None:
    B, T = seg.shape
    g = torch.Generator(args.device).manual_seed(0)
    shape = lambda h: (B, T, h, cfg.head_dim)  # noqa: E731
    inputs = [torch.randn(shape(h), device=args.device, dtype=dtype, generator=g).requires_grad_()
              for h in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)]
    docs = float(runs(seg)[:, -1].float().mean())
    base = expected = None
    for impl in args.impls:
        rec = dict(bench="attention", model=name, dist=dist, impl=impl, batch=B, seq=T, heads=cfg.n_heads,
                   kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=str(dtype).removeprefix("torch."), docs_per_row=docs)
        try:
            fn = attention_impl(impl, seg, args.device)
            if isinstance(fn, str):
                emit(**rec, skipped=fn)
                continue
            # rel_err: against sdpa_mask's output (causal: large where rows are packed)
            result, out = measure(fn, inputs, args, expected)
            rec.update(result)
            expected = out if impl == "sdpa_mask" else expected
            if impl == "flex_prebuilt":
                rec["mask_ms"] = round(block_mask_ms(seg, args), 3)
            if impl == "sdpa_mask":
                base = rec["ms"]
            if base and "pass" not in rec:
                rec["speedup_over_sdpa_mask"] = round(base / rec["ms"], 3)
        except Exception as e:  # one path failing must not hide the others' numbers
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        emit(**rec)
        for t in inputs:
            t.grad = None


def run_layer(args, name: str, cfg, dist: str, seg: torch.Tensor, dtype) -> None:
    """One rptrain DecoderBlock, fwd+bwd, per model.attention in --layers (flex on CUDA only: the CPU takes SDPA)."""
    B, T = seg.shape
    base = expected = None
    for attention in args.layers:
        rec = dict(bench="attention_layer", model=name, dist=dist, attention=attention, batch=B, seq=T, dtype=str(dtype).removeprefix("torch."))
        try:
            torch.manual_seed(0)
            block = DecoderBlock(dataclasses.replace(cfg, attention=attention, n_layers=1), 0, args.device, dtype)
            h = torch.randn(B, T, cfg.hidden_size, device=args.device, dtype=dtype, requires_grad=True)
            # fresh segments every call: a batch's first layer, where flex builds the block mask
            result, out = measure(lambda h: block((h, None, seg.clone()))[0], [h], args, expected)  # rel_err: against sdpa's
            rec.update(result)
            base, expected = base or rec["ms"], out if expected is None else expected
            rec["speedup_over_sdpa"] = round(base / rec["ms"], 3)
            del block, h, out
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        emit(**rec)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["llama_8b", "llama_3b"])
    p.add_argument("--dist", nargs="+", choices=list(DISTS), default=list(DISTS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-layer", dest="layer", action="store_false", help="skip the whole-DecoderBlock timing")
    p.add_argument("--layers", nargs="+", choices=["sdpa", "flex"], default=["sdpa", "flex"],
                   help="model.attention settings of the DecoderBlock timing (rel_err: against the first)")
    args = p.parse_args()
    if args.tiny or args.device == "cpu":
        args.model, args.seq, args.batch, args.steps, args.warmup = ["llama_tiny"], 64, 2, 2, 1
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    emit(bench="attention_env", torch=torch.__version__, device=args.device,
         gpu=torch.cuda.get_device_name() if args.device == "cuda" else None, varlen=varlen_fn() is not None)
    gen = torch.Generator().manual_seed(0)
    for name in args.model:
        cfg = decoder_config(llama_config(name, max_seq_len=max(args.seq, 256)))
        for dist in args.dist:
            seg = segments(args.batch, args.seq, dist, args.seq / 4096, gen).to(args.device)
            run_attention(args, name, cfg, dist, seg, dtype)
            if args.layer:
                run_layer(args, name, cfg, dist, seg, dtype)


if __name__ == "__main__":
    main()

"""`rptrain-export RUN_DIR_OR_CHECKPOINT OUT_DIR [--dtype fp32|bf16|fp16]`: any language-model checkpoint
as a Hugging Face folder (what a finished run writes to RUN_DIR/hf by itself).

The model is rebuilt on the meta device from the config the checkpoint was written with (stored in
it, else the run's .hydra/config.yaml) to check that the checkpoint is that model; the weights are
the checkpoint's fp32 master weights, cast to --dtype (default: the run's compute dtype).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Optional

from omegaconf import open_dict

from rptrain.models.hf_export import DTYPES
from rptrain.train.checkpoint import load_checkpoint
from rptrain.train.errors import USER_ERRORS, ConfigError, one_line
from rptrain.train.export import EMBEDDING, export_weights, exportable
from rptrain.train.model import build_model
from rptrain.train.precision import torch_dtype
from rptrain.train.run_weights import check_same_model, run_checkpoint, run_config


def _fail(message: str) -> NoReturn:
    print(f"rptrain-export: error: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rptrain-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT", help="a run directory (its checkpoints/last.pt) or a checkpoint file")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the weights' dtype on disk (default: the run's compute dtype)")
    parser.error = lambda message: _fail(f"{message}: see rptrain-export --help")  # type: ignore[method-assign]
    return parser


def export(source: str, out_dir: str, dtype_name: Optional[str] = None) -> Path:
    checkpoint = run_checkpoint(source)
    if checkpoint is None:
        raise ConfigError(f"{source} is neither a run directory with checkpoints/last.pt nor an rptrain checkpoint: give one of those")
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"OUT_DIR {out} exists and is not an empty folder: choose a new one")
    state = load_checkpoint(checkpoint)
    cfg = run_config(checkpoint, state)
    if not exportable(cfg):
        raise ConfigError(f"{checkpoint} is a model={cfg.model.name} run: only language models (model=hf, llama_*, qwen3_*) export")
    weights = state["model"]
    with open_dict(cfg):
        cfg.model.weights = None  # the checkpoint holds the weights; whatever seeded the run does not matter
    dtype = DTYPES[dtype_name] if dtype_name else torch_dtype(cfg.precision.compute_dtype)
    vocab = int(weights[EMBEDDING].shape[0]) if EMBEDDING in weights else None
    check_same_model(build_model(cfg, dtype, device="meta", vocab_size=vocab), weights, f"checkpoint {checkpoint}")
    return export_weights(cfg, weights, out, dtype)


def main(argv: Optional[list[str]] = None) -> None:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export(args.source, args.out_dir, args.dtype)
    except (*USER_ERRORS, OSError) as err:
        _fail(str(err))
    print(f"rptrain-export: wrote {out}")


if __name__ == "__main__":
    main()

"""Damaged and crafted checkpoints through every entry point that reads one: ``trainer.resume``,
``model.weights``, ``rptrain-export`` and ``rptrain-generate``. Truncations and bit flips must be
refused (or be harmless: the loaded state equals the original), configs with ``_target_`` payloads
and pickles must never run code."""
from __future__ import annotations

import copy
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Callable

import torch

from rptrain.cli import export as export_cli
from rptrain.cli import generate as generate_cli
from rptrain.cli.main import main as rptrain_main
from rptrain.train.checkpoint import load_checkpoint, save_checkpoint
from rptrain.train.checkpoint_layout import MAGIC, TRAILER, shard_files

from . import outcome as o
from .inprocess import call, judged
from .proc import LM
from .reference import differences

KINDS = ("truncated", "bit_flip", "crafted_config", "pickle_payload", "record_payload", "run_dir_config")
ENTRIES = ("resume", "model.weights", "export", "generate")


class Payload:
    """``os.system`` on unpickling: what a pickle may do if loaded with ``weights_only=False``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def make_base(work: Path) -> Path:
    run = work / "lm-base"
    code, out, err = call(rptrain_main, [*LM, "trainer.max_steps=2", "trainer.checkpoint_interval=1", f"hydra.run.dir={run}"], work)
    if code != 0:
        raise RuntimeError(f"the base language-model run failed: {err[-2000:]}")
    return run / "checkpoints" / "last.pt"


def copied(base: Path, target: Path) -> list[Path]:
    """``base`` (a manifest) copied to ``target`` with the shards it names beside it: the files to damage."""
    shutil.copyfile(base, target)
    shards = [Path(shutil.copyfile(shard, target.with_name(shard.name))) for shard in shard_files(base)]
    return [target, *shards]


def craft(kind: str, base: Path, target: Path, markers: Path, rng: random.Random) -> tuple[Path, bool, dict]:
    """Write a damaged copy of ``base`` at ``target`` (the manifest or one of its shards damaged): (what to pass,
    whether it must be refused, detail)."""
    marker = markers / f"pwned-{target.stem}"
    if kind in ("truncated", "bit_flip"):
        victim = rng.choice(copied(base, target))
        data = bytearray(victim.read_bytes())
        if kind == "truncated":
            cut = rng.randrange(0, len(data))
            victim.write_bytes(bytes(data[:cut]))
            return target, True, {"file": victim.name, "cut_at": cut, "of": len(data)}
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
        return target, None, {"file": victim.name, "byte": at, "of": len(data)}
    if kind in ("crafted_config", "run_dir_config"):
        state = load_checkpoint(base)
        config = copy.deepcopy(state["config"])
        write = {"_target_": "pathlib.Path.write_text", "self": str(marker), "data": "pwned"}
        where = rng.choice(["model.dim", "model", "optim.optimizer", "data.seed", "model.weights", "model.lora.targets"])
        if where == "model":
            config["model"].update(write)
        elif where == "model.weights":
            config["model"]["weights"] = {"_target_": "torch.load", "f": str(marker), "weights_only": False}
        elif where == "model.lora.targets":
            config["model"].setdefault("lora", {})["targets"] = [write]
        else:
            group, key = where.split(".")
            config[group][key] = dict(write)
        detail = {"where": where}
        if kind == "crafted_config":
            save_checkpoint(target, {**{k: v for k, v in state.items() if k not in ("format", "checksum")}, "config": config})
            return target, True, detail
        run = target.with_suffix("")
        (run / ".hydra").mkdir(parents=True)
        import yaml
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        save_checkpoint(run / "checkpoints" / "last.pt", {"model": state["model"]})  # no config inside: the run's is read
        return run, True, detail
    if kind == "pickle_payload":
        torch.save({"model": Payload(marker), "format": "rptrain-checkpoint-v1"}, target)
        return target, True, {}
    # record_payload: this format's own manifest frame (MAGIC, record, trailer) with a malicious record
    record = pickle.dumps({"state": Payload(marker), "tensors": []})
    target.write_bytes(MAGIC + record + TRAILER.pack(len(MAGIC), MAGIC))
    return target, True, {}


def harmless(path: Path, base: Path) -> bool:
    """A flipped bit the checksum does not cover (alignment padding): the loaded state is the original."""
    try:
        return not differences(load_checkpoint(base), load_checkpoint(path))
    except Exception:  # noqa: BLE001 - refused or unreadable: not harmless
        return False


def entry(name: str, source: Path, out: Path) -> tuple[Callable, list[str]]:
    if name == "export":
        return export_cli.main, [str(source), str(out)]
    if name == "generate":
        return generate_cli.main, [str(source), "hi", "--max-tokens", "2", "--device", "cpu"]
    option = "trainer.resume" if name == "resume" else "model.weights"
    return rptrain_main, [*LM, "trainer.max_steps=3", f"{option}={source}", f"hydra.run.dir={out}"]


def checkpoint_trial(index: int, work: Path, base: Path, markers: Path, rng: random.Random) -> o.Trial:
    kind, name = KINDS[index % len(KINDS)], ENTRIES[(index // len(KINDS)) % len(ENTRIES)]
    folder = work / f"ckpt-{index}"
    folder.mkdir()
    source, must_refuse, detail = craft(kind, base, folder / f"c{index}.pt", markers, rng)
    if must_refuse is None:
        must_refuse = not harmless(source, base)
        detail["harmless"] = not must_refuse
    if kind == "crafted_config" and name == "resume":
        must_refuse = False  # a resumed run is built from its own config: the stored one is inert data (no code may run)
    main, args = entry(name, source, folder / "out")
    code, out, err = call(main, args, folder)
    trial = judged("checkpoint", f"{kind}@{name}", code, err, markers, must_refuse, detail)
    shutil.rmtree(folder, ignore_errors=True)
    return trial

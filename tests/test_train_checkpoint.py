"""Checkpoints: a manifest and its shards, atomic replacement, checksums, keep-last-N, write errors,
fingerprints, RNG states, the older single-file layouts."""
from __future__ import annotations

import errno
import io
import random
import re

import pytest
import torch

from rptrain.train import checkpoint as ckpt
from rptrain.train import checkpoint_layout as layout
from rptrain.train.errors import CheckpointError, OutputError
from rptrain.train.resume import resolve_resume
from rptrain.train.model import fingerprint

FP = {"model": "resnet18", "params": 10, "shapes": "abc"}


def listing(directory) -> list[str]:
    """The directory's files, sorted, a shard's write id shown as *."""
    return sorted(re.sub(r"-[0-9a-f]{8}-(\d{5})\.shard$", r"-*-\1.shard", p.name) for p in directory.iterdir())


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP, "model": {"w": torch.arange(3.0)}, "step": 7})
    state = ckpt.load_checkpoint(path, FP)
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(3.0))
    assert listing(path.parent) == ["last-*-00000.shard", "last.pt"]  # no temporary file left


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP, "step": 1})

    def broken_save(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise RuntimeError("something else broke")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="something else"):
        ckpt.save_checkpoint(path, {"fingerprint": FP, "step": 2})
    monkeypatch.undo()
    assert ckpt.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def full_disk(monkeypatch, full) -> None:
    """Checkpoint files whose writes fail with ENOSPC once `full(file)` says the disk is full."""

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if full(self.f):
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    real_init = layout.Writer.__init__
    monkeypatch.setattr(layout.Writer, "__init__", lambda self, f: real_init(self, FullDisk(f)))


def test_a_full_disk_is_one_line_naming_the_file_and_the_cause(tmp_path, monkeypatch):
    """torch.save turns the file's OSError into "enforce fail ... unexpected pos": the error names ENOSPC instead."""
    directory = tmp_path / "checkpoints"
    ckpt.save_rotating(directory, {"w": torch.zeros(1000)}, 4, keep=2)

    full_disk(monkeypatch, lambda f: f.tell() > 100)
    with pytest.raises(OutputError) as info:
        ckpt.save_rotating(directory, {"w": torch.ones(1000)}, 8, keep=2)
    message = str(info.value)
    assert str(directory / "step-00000008.pt") in message and "No space left on device (ENOSPC)" in message
    assert "enforce" not in message and "\n" not in message
    monkeypatch.undo()
    assert listing(directory) == ["last.pt", "step-00000004-*-00000.shard", "step-00000004.pt"]  # nothing of the failed write
    assert torch.equal(ckpt.load_checkpoint(directory / "last.pt")["w"], torch.zeros(1000))


def test_keep_last_n_and_last_pt_is_the_newest(tmp_path):
    directory = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        ckpt.save_rotating(directory, {"step": step, "w": torch.full((10,), step)}, step, keep=2)
    assert listing(directory) == ["last.pt", "step-00000006-*-00000.shard", "step-00000006.pt", "step-00000008-*-00000.shard", "step-00000008.pt"]
    assert ckpt.load_checkpoint(directory / "last.pt")["step"] == 8
    assert (directory / "last.pt").stat().st_ino == (directory / "step-00000008.pt").stat().st_ino  # a second name, not a copy


def flip_tensor_bytes(path, offset=40):
    """Flip bytes inside the first tensor's data (which starts its first shard)."""
    with open(layout.shard_files(path)[0], "r+b") as f:
        f.seek(offset)
        data = f.read(4)
        f.seek(-4, 1)
        f.write(bytes(b ^ 0xFF for b in data))


def test_flipped_bytes_in_tensor_data_are_refused(tmp_path):
    path = tmp_path / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP, "model": {"w": torch.randn(1000)}})
    clean = layout.read_streamed(path)[0]["model"]["w"].clone()
    flip_tensor_bytes(path)
    assert not torch.equal(layout.read_streamed(path)[0]["model"]["w"], clean)  # reading alone would take it
    with pytest.raises(CheckpointError, match="fails its checksum"):
        ckpt.load_checkpoint(path, FP)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    run = tmp_path / "run"
    for step in (4, 8):
        ckpt.save_rotating(run / "checkpoints", {"step": step, "w": torch.randn(1000)}, step, keep=2)
    flip_tensor_bytes(run / "checkpoints" / "step-00000008.pt")
    choice = resolve_resume(str(run), tmp_path, None, [])
    assert choice.path == run / "checkpoints" / "step-00000004.pt"
    assert "step-00000008.pt fails its checksum" in choice.note() and "resuming from" in choice.note()
    flip_tensor_bytes(run / "checkpoints" / "step-00000004.pt")
    with pytest.raises(CheckpointError, match="no checkpoint passes verification"):
        resolve_resume(str(run), tmp_path, None, [])
    with pytest.raises(CheckpointError, match="fails its checksum"):  # a file named explicitly: refused, no fallback
        ckpt.load_checkpoint(resolve_resume(str(run / "checkpoints" / "last.pt"), tmp_path, None, []).path)


def test_fingerprint_mismatch_names_both_models(tmp_path):
    path = tmp_path / "last.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP})
    with pytest.raises(CheckpointError, match=r"resnet18 \(10 parameters\).*builds resnet34 \(20 parameters\)"):
        ckpt.load_checkpoint(path, {"model": "resnet34", "params": 20, "shapes": "abc"})
    with pytest.raises(CheckpointError, match="other layer shapes"):
        ckpt.load_checkpoint(path, {**FP, "shapes": "xyz"})


def test_corrupt_and_truncated_files(tmp_path):
    good = tmp_path / "good.pt"
    ckpt.save_checkpoint(good, {"fingerprint": FP, "model": {"w": torch.randn(1000)}})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for path in (cut, tmp_path / "missing.pt"):
        with pytest.raises(CheckpointError, match=str(path)):
            ckpt.load_checkpoint(path)
    [shard] = layout.shard_files(good)
    shard.write_bytes(shard.read_bytes()[:2000])  # a shard cut short
    with pytest.raises(CheckpointError, match="tensor 0 lies outside its file's data"):
        ckpt.load_checkpoint(good)


def test_fingerprint_follows_shapes_not_values():
    a = torch.nn.Sequential(torch.nn.Linear(3, 4))
    b = torch.nn.Sequential(torch.nn.Linear(3, 4))
    c = torch.nn.Sequential(torch.nn.Linear(3, 5))
    assert fingerprint("m", a) == fingerprint("m", b) != fingerprint("m", c)
    assert fingerprint("m", a)["params"] == 16


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(3)
    random.seed(4)
    path = tmp_path / "rng.pt"
    ckpt.save_checkpoint(path, {"rng": ckpt.rng_state()})
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    ckpt.set_rng_state(ckpt.load_checkpoint(path)["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_each_tensor_is_saved_in_its_own_dtype_and_shared_tensors_once(tmp_path):
    """int8 / bf16 / bool state comes back bit for bit in its dtype; a tensor under two names is stored once."""
    w = torch.randn(300, 7).to(torch.bfloat16)
    state = {"model": {"w": w, "head": w, "mask": torch.rand(5) > 0.5},
             "optimizer": {"state": {0: {"q": torch.randint(-128, 128, (1001,), dtype=torch.int8), "scale": torch.rand(3)}},
                           "param_groups": [{"betas": (0.9, 0.999), "lr": float("inf")}]}}
    path = tmp_path / "s.pt"
    ckpt.save_checkpoint(path, state)
    loaded = ckpt.load_checkpoint(path)
    for got, want in [(loaded["model"]["w"], w), (loaded["model"]["mask"], state["model"]["mask"]),
                      *[(loaded["optimizer"]["state"][0][k], v) for k, v in state["optimizer"]["state"][0].items()]]:
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert loaded["model"]["head"] is loaded["model"]["w"]
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    assert ckpt.checkpoint_nbytes(path) < 300 * 7 * 2 + 1001 + 2**16  # w once, int8 as one byte each


def test_a_checkpoint_of_the_older_layout_still_loads(tmp_path):
    path = tmp_path / "old.pt"
    payload = {"format": ckpt.FORMAT, "fingerprint": FP, "model": {"w": torch.arange(5.0)}}
    payload["checksum"] = ckpt.checksum(payload)
    torch.save(payload, path)
    assert ckpt.is_checkpoint(path) and torch.equal(ckpt.load_checkpoint(path, FP)["model"]["w"], torch.arange(5.0))


def write_single_file(path, state) -> None:
    """The previous version's streamed layout: MAGIC_SINGLE, each tensor's bytes on a 64-byte boundary,
    the record with references, its offset, MAGIC_SINGLE (written here the way that version wrote it)."""
    payload = {"format": ckpt.FORMAT, **state}
    payload["checksum"] = ckpt.checksum(payload)
    record, tensors = layout.unique_tensors(payload)
    out, entries = bytearray(layout.MAGIC_SINGLE), []
    for t in tensors:
        out += bytes(-len(out) % layout.ALIGN)
        entries.append({"offset": len(out), "dtype": str(t.dtype), "shape": list(t.shape)})
        out += t.contiguous().view(torch.uint8).numpy().tobytes()
    start, buf = len(out), io.BytesIO()
    torch.save({"format": ckpt.FORMAT, "tensors": entries, "state": record}, buf)
    path.write_bytes(bytes(out) + buf.getvalue() + layout.TRAILER.pack(start, layout.MAGIC_SINGLE))


def test_a_single_file_checkpoint_of_the_previous_version_still_loads(tmp_path):
    path = tmp_path / "single.pt"
    state = {"fingerprint": FP, "model": {"w": torch.randn(300), "m": torch.arange(7, dtype=torch.int8)}, "step": 3}
    write_single_file(path, state)
    loaded = ckpt.load_checkpoint(path, FP)
    assert ckpt.is_checkpoint(path) and loaded["step"] == 3
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert ckpt.checkpoint_nbytes(path) == path.stat().st_size


def test_a_cut_short_streamed_file_is_refused(tmp_path):
    path = tmp_path / "a.pt"
    ckpt.save_checkpoint(path, {"fingerprint": FP, "model": {"w": torch.randn(1000)}})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt or not a checkpoint"):
        ckpt.load_checkpoint(path)


WRITE_RSS = """
import re, sys, torch
from rptrain.train import checkpoint as ckpt
from rptrain.train import checkpoint_layout as layout
state = {"model": {"w": torch.randn(64 * 2**20 // 4)}, "optimizer": {"m": torch.randn(64 * 2**20 // 4), "v": torch.randn(64 * 2**20 // 4)}}
def high_water():  # this address space's own peak (getrusage's ru_maxrss can carry the spawning parent's size)
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
before = high_water()
ckpt.save_checkpoint(sys.argv[1], state)
print(high_water() - before)
"""


def test_writing_a_checkpoint_holds_no_second_copy_of_the_state(tmp_path):
    """192 MiB of state are written from where they live: the process's peak grows by far less than the state."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WRITE_RSS, str(tmp_path / "c.pt")], capture_output=True, text=True,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}, check=True).stdout
    assert int(out) < 32 * 2**20, out
    assert ckpt.load_checkpoint(tmp_path / "c.pt")["optimizer"]["v"].numel() == 64 * 2**20 // 4


def test_rotation_deletes_the_oldest_first_when_the_disk_is_short(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    for step in (2, 4):
        ckpt.save_rotating(directory, {"w": torch.zeros(1000)}, step, keep=3)
    free = iter([0, 0])  # never room: only the older file may go, the newest stays
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: type("U", (), {"free": next(free, 0)})())
    assert ckpt.make_room(directory, 10**6) == [directory / "step-00000002.pt"]
    assert listing(directory) == ["last.pt", "step-00000004-*-00000.shard", "step-00000004.pt"]  # its shards went with it


def test_a_big_state_is_written_as_bounded_shards_and_loads_exactly(tmp_path, monkeypatch):
    """Shards of at most SHARD_BYTES (a larger tensor alone in one), the whole state back bit for bit,
    and the checkpoint's size on disk is its manifest plus its shards."""
    monkeypatch.setattr(layout, "SHARD_BYTES", 4096)
    state = {"model": {f"w{i}": torch.randn(100 * (i + 1)) for i in range(12)}, "big": torch.randn(3000),
             "opt": {"q": torch.randint(-128, 128, (5000,), dtype=torch.int8), "empty": torch.zeros(0)}}
    path = tmp_path / "checkpoints" / "step-00000001.pt"
    ckpt.save_checkpoint(path, state)
    shards = layout.shard_files(path)
    assert len(shards) > 5 and all(s.is_file() for s in shards)
    loaded = ckpt.load_checkpoint(path)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["opt"]["q"], state["opt"]["q"])
    assert loaded["opt"]["empty"].shape == (0,)
    sizes = [s.stat().st_size for s in shards]
    assert all(n <= 4096 or n <= 3000 * 4 + layout.ALIGN for n in sizes) and max(sizes) >= 3000 * 4  # big: a shard of its own
    assert ckpt.checkpoint_nbytes(path) == path.stat().st_size + sum(sizes)
    assert ckpt.state_nbytes(state) - 2**20 >= sum(sizes)  # the disk check's estimate is not short


def test_a_missing_shard_is_one_line_naming_it(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(path, {"w": torch.randn(100)})
    [shard] = layout.shard_files(path)
    shard.unlink()
    with pytest.raises(CheckpointError) as info:
        ckpt.load_checkpoint(path)
    assert f"its shard {shard.name} is missing" in str(info.value) and "\n" not in str(info.value)


def test_a_failed_shard_stops_the_write_and_leaves_nothing_of_it(tmp_path, monkeypatch):
    """One of several shards cannot be written: no file of that write stays, the previous checkpoint verifies."""
    monkeypatch.setattr(layout, "SHARD_BYTES", 2048)
    directory = tmp_path / "checkpoints"
    ckpt.save_rotating(directory, {"w": torch.zeros(4000)}, 2, keep=2)
    full_disk(monkeypatch, lambda f: "-00003.shard" in f.name)
    with pytest.raises(OutputError, match=r"step-00000004\.pt: No space left on device"):
        ckpt.save_rotating(directory, {f"w{i}": torch.ones(500) for i in range(10)}, 4, keep=2)
    monkeypatch.undo()
    assert not [n for n in listing(directory) if n.startswith("step-00000004") or n.endswith(".tmp")]
    assert torch.equal(ckpt.load_checkpoint(directory / "last.pt")["w"], torch.zeros(4000))


def test_shards_no_manifest_names_are_removed_and_nothing_else(tmp_path):
    """A write killed before its manifest was renamed into place leaves shards: not a checkpoint, and the
    next checkpoint of the run removes them; a user's own files are left alone. Replacing a checkpoint
    removes its old shards, unless last.pt still names them."""
    directory = tmp_path / "checkpoints"
    ckpt.save_rotating(directory, {"w": torch.zeros(10)}, 2, keep=2)
    killed = directory / "step-00000004-0123abcd-00000.shard"
    killed.write_bytes(b"a shard without its manifest")
    mine = [directory / "notes.shard", directory / "step-4-backup.shard"]
    for p in mine:
        p.write_text("mine")
    assert ckpt.checkpoint_files(directory) == [directory / "step-00000002.pt"]
    ckpt.save_rotating(directory, {"w": torch.ones(10)}, 4, keep=2)
    assert not killed.exists() and all(p.exists() for p in mine)
    before = layout.shard_files(directory / "step-00000004.pt")
    ckpt.save_checkpoint(directory / "step-00000004.pt", {"w": torch.full((10,), 2.0)})  # last.pt still names the old shards
    assert all(p.exists() for p in before) and torch.equal(ckpt.load_checkpoint(directory / "last.pt")["w"], torch.ones(10))
    ckpt.save_rotating(directory, {"w": torch.full((10,), 3.0)}, 4, keep=2)  # the same step again: last.pt moves on
    assert not any(p.exists() for p in before)
    assert listing(directory) == ["last.pt", "notes.shard", "step-00000002-*-00000.shard", "step-00000002.pt",
                                  "step-00000004-*-00000.shard", "step-00000004.pt", "step-4-backup.shard"]
    assert torch.equal(ckpt.load_checkpoint(directory / "last.pt")["w"], torch.full((10,), 3.0))


def test_rotating_saves_read_no_manifest_twice(tmp_path, monkeypatch):
    """Which shards the kept checkpoints name is remembered by file: a save does not unpickle the manifests it
    wrote or read before (a background write did, every one twice a save, holding the GIL the training thread
    waited for). In a new process (a resumed run) a manifest the sweep needs is read once, not again."""
    directory = tmp_path / "checkpoints"
    ckpt.save_rotating(directory, {"w": torch.zeros(10)}, 2, keep=2)
    reads = []
    read_record = layout.read_record
    monkeypatch.setattr(layout, "read_record", lambda path: reads.append(path.name) or read_record(path))
    for step in (4, 6, 8):
        ckpt.save_rotating(directory, {"w": torch.full((10,), float(step))}, step, keep=2)
    assert reads == []
    ckpt._names_by_file.clear()  # as in a new process
    ckpt.save_rotating(directory, {"w": torch.ones(10)}, 10, keep=2)
    ckpt.save_rotating(directory, {"w": torch.ones(10)}, 12, keep=2)
    assert reads == ["step-00000008.pt"]  # step 6 went before the sweep; last.pt is a second name of step 10's, written here
    assert listing(directory) == ["last.pt", "step-00000010-*-00000.shard", "step-00000010.pt", "step-00000012-*-00000.shard", "step-00000012.pt"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_written_from_the_gpu_by_parallel_writers(tmp_path, monkeypatch):
    """A GPU share's tensors (bf16, int8, one larger than a copy chunk) are written by several shard writers
    at once, a chunk at a time, and load back bit for bit on the host."""
    monkeypatch.setattr(layout, "SHARD_BYTES", 2**20)
    monkeypatch.setattr(layout, "CHUNK_BYTES", 2**18)
    state = {"model": {f"w{i}": torch.randn(2**18, device="cuda").to(torch.bfloat16) for i in range(6)},
             "opt": {"q": torch.randint(-128, 128, (3 * 2**20,), dtype=torch.int8, device="cuda"), "host": torch.randn(1000)}}
    path = tmp_path / "gpu.pt"
    ckpt.save_checkpoint(path, state)
    assert len(layout.shard_files(path)) >= 4
    loaded = ckpt.load_checkpoint(path)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v.cpu())
    assert torch.equal(loaded["opt"]["q"], state["opt"]["q"].cpu()) and torch.equal(loaded["opt"]["host"], state["opt"]["host"])

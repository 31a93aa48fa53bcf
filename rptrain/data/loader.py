"""Exact, resumable, shardable batches over tensors held in memory.

Everything random is a pure function of (seed, epoch, rank, batch index):
  * sample order: torch.Generator().manual_seed(seed + epoch) -> randperm, the
    recipe torch's DistributedSampler uses, shared by all ranks;
  * the transform's generator for batch b: seeded from mix_seed(seed, epoch, rank, b).
So a run stopped after batch k and resumed with epoch(e, start_batch=k+1)
(or load_state_dict) yields bit-identical batches, with nothing to replay.

Sharding follows DistributedSampler followed by DataLoader(drop_last=...):
rank r reads positions r, r+W, r+2W, ... of the global permutation.
  * drop_last=True: the permutation's tail is cut to a multiple of W, and each
    rank's last partial batch is dropped;
  * drop_last=False: the permutation is padded by wrapping around to its
    start (a few samples appear twice per epoch), and the last partial batch
    is kept.
Either way every rank has the same number of batches, so collective ops in
the training step never wait on a rank that ran out of data.
"""
from __future__ import annotations

import itertools
import queue
import threading
from typing import Callable, Iterator, Sequence

import torch

from .errors import DataError
from .transfer import to_device

Batch = tuple[torch.Tensor, ...]
Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """Hash integers into one 63-bit seed (splitmix64 steps), so nearby inputs give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h >> 1


def shard_indices(
    n: int, seed: int, epoch: int, shuffle: bool, rank: int = 0, world_size: int = 1, drop_last: bool = True
) -> torch.Tensor:
    """This rank's sample indices for one epoch, identical to DistributedSampler's."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(n)
    if drop_last:
        order = order[: n - n % world_size]
    elif n % world_size:
        pad = world_size - n % world_size
        order = torch.cat([order, order.repeat(pad // n + 1)[:pad]])
    return order[rank::world_size]


class ShardedLoader:
    """Bookkeeping shared by the loaders: shard sizes, batch count, resume position."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        rank: int,
        world_size: int,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        shard = num_samples // world_size if drop_last else -(-num_samples // world_size)
        self.num_batches = shard // batch_size if drop_last else -(-shard // batch_size)
        if self.num_batches == 0:
            raise DataError(
                f"{num_samples} samples give no batch of {batch_size} per rank with world_size={world_size}: "
                f"lower batch_size or set drop_last=false"
            )
        # Position of the next batch to hand out; advanced as batches are yielded.
        self.current_epoch, self.next_batch = 0, 0

    def __len__(self) -> int:
        return self.num_batches

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's indices for `epoch`, cut to whole batches when drop_last."""
        idx = shard_indices(self.num_samples, self.seed, epoch, self.shuffle, self.rank, self.world_size, self.drop_last)
        return idx[: self.num_batches * self.batch_size]

    def _check_start(self, start_batch: int) -> None:
        if not 0 <= start_batch <= self.num_batches:
            raise DataError(f"start_batch={start_batch} is outside an epoch of {self.num_batches} batches")

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        raise NotImplementedError

    def position(self) -> tuple[int, int]:
        """(epoch, batch) of the next batch to hand out."""
        if self.next_batch >= self.num_batches:  # the epoch is finished; go on with the next one
            return self.current_epoch + 1, 0
        return self.current_epoch, self.next_batch

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch from the saved position (fresh loader: all of epoch 0)."""
        return self.epoch(*self.position())

    def state_dict(self) -> dict[str, int]:
        epoch, batch = self.position()
        return {
            "seed": self.seed,
            "epoch": epoch,
            "batch": batch,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        # A different batch size, world size or dataset would silently give a different order.
        for key in ("batch_size", "world_size", "num_samples"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"loader state has {key}={state[key]} but this loader has {key}={getattr(self, key)}: "
                    f"resume with the same data and batch settings"
                )
        self.seed = int(state["seed"])
        self.current_epoch, self.next_batch = int(state["epoch"]), int(state["batch"])
        self._check_start(self.next_batch)


class BatchLoader(ShardedLoader):
    """Batches of equal-length tensors, e.g. (images, labels) or (inputs, targets).

    for epoch in range(epochs):
        for images, labels in loader.epoch(epoch):
            ...

    Each batch is a tuple with one tensor per input tensor. `transform`, if
    given, is applied to the first tensor of each batch after it reached
    `device`, as transform(x, generator) (BatchAugment fits). Tensors may
    already live on the GPU, in which case indexing happens there.

    chunk_batches=k gathers and transforms k consecutive batches with one set of
    kernels and hands them out as slices: on a GPU the loader's host time per batch
    (a dozen kernel launches, which a busy training process delays further)
    shrinks k-fold. It needs a transform that draws apart from applying
    (BatchAugment) or none; with any other transform batches are made one by one.
    The batches are bit-identical whatever k is.

    prefetch=True prepares the next chunk in one background thread while the
    current one is used; the thread is joined when the epoch's iterator ends
    or is closed. Off by default: gathering a batch from memory takes well under
    a millisecond, so the thread rarely pays for itself (on an H200 it made a
    bare CIFAR epoch slower), and it makes failures harder to read.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor] | torch.Tensor,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        transform: Transform | None = None,
        device: torch.device | str | None = None,
        prefetch: bool = False,
        chunk_batches: int = 1,
    ) -> None:
        if chunk_batches < 1:
            raise DataError(f"chunk_batches={chunk_batches} must be >= 1")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if not tensors:
            raise DataError("BatchLoader needs at least one tensor")
        sizes = [len(t) for t in tensors]
        if len(set(sizes)) != 1:
            raise DataError(f"BatchLoader tensors must have the same first dimension, got {sizes}")
        super().__init__(sizes[0], batch_size, shuffle, drop_last, seed, rank, world_size)
        self.tensors = tensors
        self.transform = transform
        self.device = torch.device(device) if device is not None else None
        self.prefetch = prefetch
        # A transform that draws per batch from its own generator cannot be applied to several at once.
        self.chunk_batches = chunk_batches if transform is None or _splits(transform) else 1

    def transform_generator(self, epoch: int, batch: int) -> torch.Generator:
        return torch.Generator().manual_seed(mix_seed(self.seed, epoch, self.rank, batch))

    def load_batch(self, indices: torch.Tensor, epoch: int, batch: int, draws: torch.Tensor | None = None) -> Batch:
        """Gather rows `indices` of every tensor, move them to the device, transform. `draws`: the
        batch's part of epoch_draws(), when the transform splits drawing from applying."""
        out = []
        on_device: dict[torch.device, torch.Tensor] = {}
        for t in self.tensors:
            if t.device not in on_device:
                on_device[t.device] = to_device(indices, t.device)
            x = t[on_device[t.device]]
            if self.device is not None and x.device != self.device:
                x = to_device(x, self.device)
            out.append(x)
        if self.transform is not None:
            if draws is not None:
                out[0] = self.transform.apply(out[0], draws)
            else:
                out[0] = self.transform(out[0], self.transform_generator(epoch, batch))
        return tuple(out)

    def epoch_draws(self, epoch: int, sizes: Sequence[int], start_batch: int) -> torch.Tensor | None:
        """Every batch's random draws from its own generator, as one (k, total) tensor: the same
        numbers a batch-by-batch call would draw, so resumed runs still match."""
        if not _splits(self.transform):
            return None
        parts = [self.transform.draw(n, self.transform_generator(epoch, b)) for b, n in enumerate(sizes) if b >= start_batch]
        if not parts or parts[0] is None:
            return None
        return torch.cat(parts, dim=1)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """Yield batches start_batch..len(self)-1 of `epoch`, tracking the position for state_dict()."""
        self._check_start(start_batch)
        bs = self.batch_size
        order = self.indices(epoch)
        sizes = [min(bs, len(order) - b * bs) for b in range(self.num_batches)]
        order = order[start_batch * bs :]
        draws = self.epoch_draws(epoch, sizes, start_batch)
        # One copy per epoch to where the data and the augmentation live, instead of two per batch.
        where = self.tensors[0].device if self.device is None else self.device
        if where.type == "cuda" and all(t.device == where for t in self.tensors):
            order = to_device(order, where)
        if draws is not None:
            draws = to_device(draws, where)

        def make(first: int) -> list[Batch]:
            last = min(first + self.chunk_batches, self.num_batches)
            lo = (first - start_batch) * bs
            hi = lo + sum(sizes[first:last])
            chunk = self.load_batch(order[lo:hi], epoch, first, None if draws is None else draws[:, lo:hi])
            ends = list(itertools.accumulate(sizes[first:last]))
            return [tuple(t[end - n : end] for t in chunk) for n, end in zip(sizes[first:last], ends)]

        batches = range(start_batch, self.num_batches)
        firsts = range(start_batch, self.num_batches, self.chunk_batches)
        chunks = _prefetched(make, firsts) if self.prefetch else (make(b) for b in firsts)
        source = (batch for chunk in chunks for batch in chunk)
        try:
            for b, batch in zip(batches, source):
                self.current_epoch, self.next_batch = epoch, b + 1
                yield batch
        finally:
            source.close()
            chunks.close()


def _splits(transform: Transform | None) -> bool:
    """Whether the transform draws its random numbers apart from applying them (BatchAugment does)."""
    return hasattr(transform, "draw") and hasattr(transform, "apply")


def _prefetched(make: Callable[[int], list[Batch]], batches: range) -> Iterator[list[Batch]]:
    """Run make(b) for each b one step ahead in a background thread; joined on exit."""
    q: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def work() -> None:
        for b in batches:
            try:
                item = (make(b), None)
            except BaseException as err:  # handed to the consumer, which re-raises it
                item = (None, err)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if stop.is_set() or item[1] is not None:
                return

    thread = threading.Thread(target=work, name="rptrain-prefetch", daemon=True)
    thread.start()
    try:
        for _ in batches:
            batch, err = q.get()
            if err is not None:
                raise err
            yield batch
    finally:
        stop.set()
        thread.join()

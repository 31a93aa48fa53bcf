"""BatchLoader / DatasetLoader: exact order, resume, sharding."""
import threading

import pytest
import torch
from torch.utils.data import DistributedSampler

from cifar_fixture import fake_cifar
from rptrain.data import (
    CIFAR100_MEAN,
    CIFAR100_STD,
    BatchAugment,
    BatchLoader,
    DataError,
    DatasetLoader,
    cifar_dataset,
    cifar_train_transforms,
    shard_indices,
)


def _ids(n):
    """A dataset whose only content is each sample's index, so batches reveal the order."""
    return torch.arange(n)


def _flat(batches):
    return torch.cat([b[0] for b in batches]).tolist()


@pytest.mark.parametrize("n,world,drop_last,shuffle", [(10, 2, True, True), (11, 2, True, True), (11, 3, False, True), (5, 4, False, True), (7, 2, False, False)])
def test_shard_indices_match_distributed_sampler(n, world, drop_last, shuffle):
    for epoch in (0, 3):
        for rank in range(world):
            ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=17, drop_last=drop_last)
            ref.set_epoch(epoch)
            assert shard_indices(n, 17, epoch, shuffle, rank, world, drop_last).tolist() == list(ref)


def test_permutation_is_seed_plus_epoch_and_deterministic():
    a = BatchLoader(_ids(50), batch_size=10, seed=3)
    b = BatchLoader(_ids(50), batch_size=10, seed=3)
    assert _flat(a.epoch(2)) == _flat(b.epoch(2))
    assert _flat(a.epoch(2)) == torch.randperm(50, generator=torch.Generator().manual_seed(5)).tolist()
    assert _flat(a.epoch(1)) != _flat(a.epoch(2))
    assert _flat(BatchLoader(_ids(50), batch_size=10, shuffle=False).epoch(4)) == list(range(50))


def test_lengths_and_last_batch():
    assert len(BatchLoader(_ids(25), batch_size=10, drop_last=True)) == 2
    loader = BatchLoader(_ids(25), batch_size=10, drop_last=False)
    assert len(loader) == 3
    assert [len(b[0]) for b in loader.epoch(0)] == [10, 10, 5]


def _cifar_like(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g), torch.randint(0, 100, (n,), generator=g)


def _aug_loader(**kw):
    images, labels = _cifar_like()
    return BatchLoader((images, labels), batch_size=8, seed=11, transform=BatchAugment(CIFAR100_MEAN, CIFAR100_STD), **kw)


def test_resume_mid_epoch_reproduces_batches_and_augmentation():
    full = list(_aug_loader().epoch(1))
    assert len(full) == 8

    # Run 3 batches, checkpoint, and resume in a fresh loader ("a new process").
    first = _aug_loader()
    it = first.epoch(1)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batch"] == 3
    resumed = _aug_loader()
    resumed.load_state_dict(state)
    rest = list(resumed)  # iterating the loader continues from the loaded position
    assert len(rest) == 5
    for (x, y), (rx, ry) in zip(full[3:], rest):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    # The explicit form gives the same batches.
    for (x, _), (rx, _) in zip(full[5:], _aug_loader().epoch(1, start_batch=5)):
        assert torch.equal(x, rx)
    # Augmentation really differs batch to batch (each batch has its own generator).
    assert not torch.equal(full[0][0][:1], full[1][0][:1])


@pytest.mark.parametrize("start", [0, 3])
def test_epoch_draws_equal_batch_by_batch_augmentation(start):
    """The loader draws an epoch's crops and flips at once; each batch must still get exactly what
    BatchAugment(images, the batch's own generator) gives, the short last batch included."""
    images, labels = _cifar_like(61)
    augment = BatchAugment(CIFAR100_MEAN, CIFAR100_STD)
    loader = BatchLoader((images, labels), batch_size=8, seed=11, drop_last=False, transform=augment)
    order = loader.indices(2)
    batches = list(loader.epoch(2, start_batch=start))
    assert len(batches) == 8 - start and len(batches[-1][1]) == 61 - 7 * 8
    for b, (x, y) in enumerate(batches, start):
        rows = order[b * 8 : (b + 1) * 8]
        assert torch.equal(y, labels[rows])
        assert torch.equal(x, augment(images[rows], loader.transform_generator(2, b)))


@pytest.mark.parametrize("chunk,start,prefetch", [(3, 0, False), (3, 4, False), (16, 2, False), (3, 1, True)])
def test_chunked_batches_equal_batch_by_batch(chunk, start, prefetch):
    """Gathering and augmenting several batches at once must hand out exactly the batches one at a
    time would: the short last batch, a start inside a chunk and the prefetch thread included."""
    images, labels = _cifar_like(61)
    make = lambda k, p=False: BatchLoader((images, labels), batch_size=8, seed=11, drop_last=False,
                                          transform=BatchAugment(CIFAR100_MEAN, CIFAR100_STD), chunk_batches=k, prefetch=p)
    one = list(make(1).epoch(2, start_batch=start))
    loader = make(chunk, prefetch)
    it = loader.epoch(2, start_batch=start)
    for b, (x, y) in enumerate(one, start):
        cx, cy = next(it)
        assert torch.equal(cx, x) and torch.equal(cy, y)
        assert loader.next_batch == b + 1  # the position follows the batch handed out, not the chunk
    assert next(it, None) is None


def test_chunking_falls_back_to_single_batches_for_a_plain_transform():
    """A transform that only takes a generator draws per batch: chunks would change the numbers."""
    noise = lambda x, g: x + torch.rand(x.shape, generator=g)
    one = list(BatchLoader(_ids(20).float(), batch_size=4, transform=noise).epoch(0))
    chunked = BatchLoader(_ids(20).float(), batch_size=4, transform=noise, chunk_batches=4)
    assert chunked.chunk_batches == 1
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, chunked.epoch(0)))
    assert _flat(BatchLoader(_ids(20), batch_size=4, chunk_batches=3).epoch(1)) == _flat(BatchLoader(_ids(20), batch_size=4).epoch(1))


def test_state_after_a_full_epoch_points_at_the_next():
    loader = BatchLoader(_ids(20), batch_size=5)
    list(loader.epoch(0))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch"] == 0
    assert _flat(loader) == _flat(BatchLoader(_ids(20), batch_size=5).epoch(1))
    assert loader.state_dict()["epoch"] == 2


@pytest.mark.parametrize("n,drop_last", [(40, True), (37, True), (37, False)])
def test_two_ranks_split_the_global_permutation(n, drop_last):
    ranks = [BatchLoader(_ids(n), batch_size=4, seed=5, rank=r, world_size=2, drop_last=drop_last) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    parts = [_flat(r.epoch(3)) for r in ranks]
    assert len(parts[0]) == len(parts[1])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5 + 3)).tolist()
    if drop_last:
        assert not set(parts[0]) & set(parts[1])  # disjoint
        covered = sorted(parts[0] + parts[1])
        assert covered == sorted(perm[: len(covered)])  # a prefix of the one global permutation
        assert len(covered) == (n // 2) // 4 * 4 * 2
    else:
        assert set(parts[0]) | set(parts[1]) == set(range(n))  # everything seen; the pad repeats perm's start
        assert parts[0][: n // 2] == perm[0 : n - 1 : 2][: n // 2]


def test_transform_generators_differ_by_rank_and_batch():
    loaders = [BatchLoader(_ids(8), batch_size=2, rank=r, world_size=2) for r in range(2)]
    draws = {(r, b): torch.rand(1, generator=l.transform_generator(0, b)).item() for r, l in enumerate(loaders) for b in range(2)}
    assert len(set(draws.values())) == 4


def test_prefetch_gives_same_batches_and_joins_thread():
    plain = list(_aug_loader().epoch(0))
    fetched = list(_aug_loader(prefetch=True).epoch(0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain, fetched))
    it = _aug_loader(prefetch=True).epoch(0)
    next(it)
    it.close()  # stopping mid-epoch joins the worker
    assert not [t for t in threading.enumerate() if t.name == "rptrain-prefetch"]


def test_prefetch_reraises_worker_errors():
    def broken(x, g):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        list(BatchLoader(_ids(8), batch_size=2, transform=broken, prefetch=True).epoch(0))


def test_bad_settings_raise_data_error():
    with pytest.raises(DataError, match="same first dimension"):
        BatchLoader((torch.zeros(4), torch.zeros(5)), batch_size=2)
    with pytest.raises(DataError, match="batch_size"):
        BatchLoader(_ids(4), batch_size=0)
    with pytest.raises(DataError, match="chunk_batches=0"):
        BatchLoader(_ids(4), batch_size=1, chunk_batches=0)
    with pytest.raises(DataError, match="rank"):
        BatchLoader(_ids(4), batch_size=1, rank=2, world_size=2)
    with pytest.raises(DataError, match="no batch of 8"):
        BatchLoader(_ids(10), batch_size=8, world_size=2)
    loader = BatchLoader(_ids(10), batch_size=2)
    with pytest.raises(DataError, match="batch_size=5"):
        loader.load_state_dict({**loader.state_dict(), "batch_size": 5})
    with pytest.raises(DataError, match="start_batch"):
        next(loader.epoch(0, start_batch=9))


def test_dataset_loader_is_deterministic_resumable_and_worker_independent(tmp_path, monkeypatch):
    root = fake_cifar(tmp_path, monkeypatch, "cifar100", n_train=48, n_test=10)
    ds = cifar_dataset("cifar100", root, train=True, transform=cifar_train_transforms(CIFAR100_MEAN, CIFAR100_STD))
    make = lambda workers=0: DatasetLoader(ds, batch_size=8, seed=2, num_workers=workers)  # noqa: E731
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    full = list(make().epoch(1))
    assert torch.equal(torch.get_rng_state(), global_state)  # per-sample seeding leaves the caller's RNG alone
    assert len(full) == 6 and full[0][0].shape == (8, 3, 32, 32) and full[0][0].dtype == torch.float32
    resumed = make()
    resumed.load_state_dict({**resumed.state_dict(), "epoch": 1, "batch": 4})
    rest = list(resumed)
    assert len(rest) == 2
    for (x, y), (rx, ry) in zip(full[4:], rest):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with_workers = list(make(workers=2).epoch(1))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, with_workers))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_batches_match_cpu():
    cpu = list(_aug_loader().epoch(0))
    for prefetch, chunk in ((False, 1), (True, 1), (False, 3)):
        gpu = list(_aug_loader(device="cuda", prefetch=prefetch, chunk_batches=chunk).epoch(0))
        assert gpu[0][0].is_cuda and gpu[0][1].is_cuda
        for a, b in zip(cpu, gpu):
            torch.testing.assert_close(b[0].cpu(), a[0], atol=1e-5, rtol=0)
            assert torch.equal(b[1].cpu(), a[1])
    # Data already on the GPU is indexed there.
    images, labels = _cifar_like()
    on_gpu = BatchLoader((images.cuda(), labels.cuda()), batch_size=8, seed=11, transform=BatchAugment(CIFAR100_MEAN, CIFAR100_STD))
    for a, b in zip(cpu, on_gpu.epoch(0)):
        torch.testing.assert_close(b[0].cpu(), a[0], atol=1e-5, rtol=0)

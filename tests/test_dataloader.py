"""patch_dataloader_to_ddp: what gets wrapped, what carries over, and a real 3-process gloo run."""
from __future__ import annotations

import multiprocessing
import re
import sys
import warnings
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np
import pytest
import torch
from distributed_helpers import run_distributed, worker_context
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from lightning_ddp_ext import consistency, dataloader, patch_dataloader_to_ddp
from lightning_ddp_ext.consistency import (
    NOT_DEALT,
    NOT_DEALT_SOURCE,
    SequenceDigest,
    report_failure,
    verify_same_sequence,
)
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper, DistributedSamplerWrapper


class Squares(Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, index: int) -> int:
        return index


class ClassBalancedBatches:
    """P x K-like batch sampler that subclasses nothing and takes no `sampler` argument."""

    def __init__(self, size: int, batch_size: int, seed: int = 0) -> None:
        self.size, self.batch_size, self.seed, self.epoch = size, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size // self.batch_size

    def __iter__(self) -> Iterator[List[int]]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for b in range(len(self)):
            yield order[b * self.batch_size : (b + 1) * self.batch_size]


def collate_identity(batch: List[int]) -> List[int]:
    return batch


def test_custom_batch_sampler_is_dealt_whole_and_arguments_carry_over() -> None:
    generator = torch.Generator()
    loader = DataLoader(
        Squares(), batch_sampler=ClassBalancedBatches(30, 4), collate_fn=collate_identity, generator=generator
    )
    patched = patch_dataloader_to_ddp(loader, num_replicas=2, rank=1)
    assert isinstance(patched.batch_sampler, DistributedBatchSamplerWrapper)
    assert patched.batch_sampler.batch_sampler is loader.batch_sampler
    assert (
        patched.collate_fn is collate_identity and patched.generator is generator and patched.dataset is loader.dataset
    )
    user = list(loader.batch_sampler)  # type: ignore[arg-type]
    assert list(patched) == user[1::2] + [user[0]]  # 7 batches: the last round is padded with the first


def test_default_samplers_become_distributed_sampler() -> None:
    shuffled = patch_dataloader_to_ddp(DataLoader(Squares(), batch_size=4, shuffle=True, drop_last=True), 3, 0, seed=5)
    assert isinstance(shuffled.sampler, DistributedSampler)
    assert shuffled.sampler.shuffle and shuffled.sampler.seed == 5 and shuffled.batch_size == 4 and shuffled.drop_last
    sequential = patch_dataloader_to_ddp(DataLoader(Squares(), batch_size=4), 3, 2)
    assert isinstance(sequential.sampler, DistributedSampler) and not sequential.sampler.shuffle
    assert [b.tolist() for b in sequential] == [[2, 5, 8, 11], [14, 17, 20, 23], [26, 29]]


def test_custom_index_sampler_under_plain_batch_sampler_is_wrapped() -> None:
    weighted = WeightedRandomSampler([1.0] * 30, 30, generator=torch.Generator().manual_seed(0))
    patched = patch_dataloader_to_ddp(DataLoader(Squares(), batch_size=5, sampler=weighted), 2, 0)
    assert isinstance(patched.sampler, DistributedSamplerWrapper) and patched.sampler.sampler is weighted
    assert patched.batch_size == 5 and len(patched) == 3
    with_replacement = RandomSampler(Squares(), replacement=True)
    assert isinstance(
        patch_dataloader_to_ddp(DataLoader(Squares(), sampler=with_replacement), 2, 0).sampler,
        DistributedSamplerWrapper,
    )


def test_plain_batch_sampler_passed_as_batch_sampler_keeps_its_sampler_size_and_drop_last() -> None:
    """DataLoader(batch_sampler=BatchSampler(...)) leaves loader.sampler a default SequentialSampler and
    loader.batch_size None: the batch sampler's own sampler, size and drop_last are what must carry over."""
    weighted = WeightedRandomSampler([1.0] * 30, 30, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(Squares(), batch_sampler=BatchSampler(weighted, 4, drop_last=True))
    shares = [patch_dataloader_to_ddp(loader, 2, r) for r in range(2)]
    for patched in shares:
        assert isinstance(patched.sampler, DistributedSamplerWrapper) and patched.sampler.sampler is weighted
        assert patched.batch_size == 4 and patched.drop_last
    for rank, patched in enumerate(shares):
        weighted.generator.manual_seed(1)  # type: ignore[union-attr]
        share = list(weighted)[rank::2]  # the user's draws, dealt; then batched by 4, the last 3 dropped
        weighted.generator.manual_seed(1)  # type: ignore[union-attr]
        assert [batch.tolist() for batch in patched] == [share[0:4], share[4:8], share[8:12]]
    sequential = DataLoader(
        Squares(), batch_sampler=BatchSampler(range(30), 3, drop_last=False)  # type: ignore[arg-type]
    )
    assert [b.tolist() for b in patch_dataloader_to_ddp(sequential, 2, 1)][:2] == [[1, 3, 5], [7, 9, 11]]


def test_already_sharded_inside_a_plain_batch_sampler_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataloader, "_warned", set())  # warnings given once per process: none given yet
    inner = DistributedSampler(Squares(), num_replicas=2, rank=0)
    loader = DataLoader(Squares(), batch_sampler=BatchSampler(inner, 4, drop_last=False))
    assert patch_dataloader_to_ddp(loader, 2, 0) is loader
    with warnings.catch_warnings():  # without a process group too, silently: the reason would be the wrong one
        warnings.simplefilter("error")
        assert patch_dataloader_to_ddp(patch_dataloader_to_ddp(DataLoader(Squares()), 2, 1)).sampler.rank == 1


def test_default_sampler_types_over_another_data_source_are_wrapped_not_replaced() -> None:
    """A SequentialSampler over six of the thirty samples must not become a DistributedSampler over all 30."""
    loader = DataLoader(Squares(), sampler=SequentialSampler(range(6)), batch_size=2)
    shares = [[b.tolist() for b in patch_dataloader_to_ddp(loader, 2, r)] for r in range(2)]
    assert shares == [[[0, 2], [4]], [[1, 3], [5]]]
    permuted = RandomSampler(range(6), generator=torch.Generator().manual_seed(0))
    patched = patch_dataloader_to_ddp(DataLoader(Squares(), sampler=permuted, batch_size=2), 2, 0)
    assert isinstance(patched.sampler, DistributedSamplerWrapper) and patched.sampler.sampler is permuted


def test_numpy_and_torch_integers_are_accepted_as_world_and_rank() -> None:
    patched = patch_dataloader_to_ddp(DataLoader(Squares(), batch_size=5), np.int64(3), torch.tensor(1))
    assert patched.sampler.num_replicas == 3 and patched.sampler.rank == 1  # type: ignore[attr-defined]
    wrapper = DistributedBatchSamplerWrapper([[0], [1], [2]], num_replicas=np.int32(2), rank=np.int64(1))
    assert type(wrapper.num_replicas) is int and list(wrapper) == [[1], [0]]


def test_batch_sampler_subclass_with_own_init_is_not_reinstantiated() -> None:
    class Buckets(BatchSampler):
        def __init__(self, lengths: List[int]) -> None:  # no `sampler` argument: Lightning cannot rebuild this
            self.lengths = lengths

        def __iter__(self) -> Iterator[List[int]]:
            order = sorted(range(len(self.lengths)), key=self.lengths.__getitem__)
            return (order[i : i + 3] for i in range(0, len(order), 3))

        def __len__(self) -> int:
            return -(-len(self.lengths) // 3)

    lengths = [(i * 7) % 11 for i in range(30)]
    loader = DataLoader(Squares(), batch_sampler=Buckets(lengths), collate_fn=collate_identity)
    shares = [list(patch_dataloader_to_ddp(loader, 2, r)) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(list(Buckets(lengths)))


def test_without_automatic_batching_indices_are_dealt() -> None:
    loader = DataLoader(Squares(), batch_size=None, sampler=list(range(7)))  # type: ignore[arg-type]
    assert [int(x) for x in patch_dataloader_to_ddp(loader, 2, 1)] == [1, 3, 5, 0]


class BatchFetching(Dataset):
    """A dataset that fetches a whole batch for a list of keys, as with ``DataLoader(sampler=BatchSampler(...),
    batch_size=None)``."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, keys: List[int]) -> List[int]:
        return [key * 10 for key in keys]


class Pairs(BatchSampler):
    """A BatchSampler subclass that builds its own batches: pairs of indices, reversed."""

    def __init__(self) -> None:
        pass

    def __iter__(self) -> Iterator[List[int]]:
        return iter([[1, 0], [3, 2], [5, 4]])

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize(
    "batches", [BatchSampler(SequentialSampler(range(10)), 3, drop_last=False), Pairs()], ids=["plain", "subclass"]
)
def test_a_batch_sampler_given_as_sampler_without_automatic_batching_is_dealt_whole(batches: BatchSampler) -> None:
    """Its items are batches: each rank gets whole ones, fetched as the single-process loader fetches them."""
    loader = DataLoader(BatchFetching(), sampler=batches, batch_size=None)
    whole = list(loader)
    shares = [list(patch_dataloader_to_ddp(loader, 2, rank, pad=False)) for rank in range(2)]
    assert shares == [whole[0::2][: len(whole) // 2], whole[1::2][: len(whole) // 2]]
    assert isinstance(patch_dataloader_to_ddp(loader, 2, 0).sampler, DistributedBatchSamplerWrapper)


def test_a_batch_sampler_given_as_sampler_over_a_distributed_sampler_is_left_as_it_is() -> None:
    """The user sharded it already: dealing its batches again would drop half of each rank's share."""
    sharded = BatchSampler(DistributedSampler(range(16), num_replicas=2, rank=0, shuffle=False), 2, False)
    loader = DataLoader(BatchFetching(), sampler=sharded, batch_size=None)
    assert patch_dataloader_to_ddp(loader, 2, 0) is loader


def test_unchanged_with_warning_when_nothing_to_shard() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    stream = DataLoader(Stream())
    with pytest.warns(UserWarning, match="IterableDataset"):
        assert patch_dataloader_to_ddp(stream, 2, 0) is stream
    plain = DataLoader(Squares())
    with pytest.warns(UserWarning, match="no process group"):
        assert patch_dataloader_to_ddp(plain) is plain
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patch_dataloader_to_ddp(plain) is plain  # warned once only


DEFAULT_STARTS_BY_FORK = multiprocessing.get_all_start_methods()[0] == "fork"  # Linux before Python 3.14


@pytest.mark.parametrize(
    "version,workers,context,warns",
    [
        ((3, 11, 7), 2, None, DEFAULT_STARTS_BY_FORK),
        ((3, 11, 9), 1, "fork", True),
        ((3, 10, 14), 1, "fork", True),
        ((3, 9, 19), 1, "fork", True),
        ((3, 11, 10), 2, "fork", False),
        ((3, 10, 15), 2, "fork", False),
        ((3, 12, 0), 2, "fork", False),
        ((3, 11, 7), 0, None, False),
        ((3, 11, 7), 2, "forkserver", False),
        ((3, 11, 7), 2, "spawn", False),
    ],
)
def test_forked_workers_on_an_affected_python_are_named(
    version: tuple, workers: int, context: Any, warns: bool
) -> None:
    loader = DataLoader(Squares(), num_workers=workers, multiprocessing_context=context)
    message = dataloader._fork_deadlock_warning(loader, version)
    if not warns:
        assert message is None
        return
    assert message is not None
    release = ".".join(map(str, version))
    fixed = {(3, 9): "3.9.20", (3, 10): "3.10.15", (3, 11): "3.11.10"}[version[:2]]
    assert f"Python {release} can deadlock a forked worker" in message and f"fixed in {fixed}" in message
    assert "multiprocessing_context='spawn', persistent_workers=True" in message


def test_patching_forked_workers_warns_once_where_python_is_affected(monkeypatch: pytest.MonkeyPatch) -> None:
    major_minor, micro = sys.version_info[:2], sys.version_info[2]
    monkeypatch.setattr(dataloader, "_warned", set())
    monkeypatch.setitem(dataloader._FORK_DEADLOCK_FIXED_IN, major_minor, micro + 1)  # as if this Python were affected
    forked = DataLoader(Squares(), batch_size=4, num_workers=1, multiprocessing_context="fork")
    with pytest.warns(UserWarning, match="gh-112275"):
        patch_dataloader_to_ddp(forked, 2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_dataloader_to_ddp(forked, 2, 1)  # once per process
        patch_dataloader_to_ddp(DataLoader(Squares(), num_workers=1, multiprocessing_context="forkserver"), 2, 0)
        monkeypatch.setattr(dataloader, "_warned", set())
        patch_dataloader_to_ddp(forked, 1, 0)  # one rank: nothing waits on it
        monkeypatch.setitem(dataloader._FORK_DEADLOCK_FIXED_IN, major_minor, micro)  # this Python has the fix
        patch_dataloader_to_ddp(forked, 2, 0)


def test_unknown_option_is_rejected() -> None:
    with pytest.raises(TypeError, match="unknown option"):
        patch_dataloader_to_ddp(DataLoader(Squares()), 2, 0, shufle=True)


def _three_rank_epochs(rank: int, world_size: int) -> Any:
    loader = DataLoader(
        Squares(), batch_sampler=ClassBalancedBatches(30, 4, seed=11), num_workers=2,
        multiprocessing_context=worker_context("lightning_ddp_ext", "pytest"),  # this module imports them
    )
    patched = patch_dataloader_to_ddp(loader, shuffle=True, shuffle_window=1)  # world and rank from the group
    assert patched.num_workers == 2 and patched.multiprocessing_context is loader.multiprocessing_context
    seen = []
    for epoch in range(2):
        patched.batch_sampler.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        seen.append([batch.tolist() for batch in patched])
    gathered: List[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, seen)
    # The consistency check: a seeded sampler agrees across ranks, an unseeded one is caught.
    seeded = DistributedBatchSamplerWrapper(ClassBalancedBatches(30, 4, seed=11))
    next(iter(seeded))
    verify_same_sequence(seeded.head_digest)
    unseeded = DistributedBatchSamplerWrapper(BatchSampler(RandomSampler(range(30)), 4, False))
    next(iter(unseeded))
    # The same seeded sequence, dealt with a seed that differs per rank (shares overlap) or for different epochs.
    seed_per_rank = DistributedBatchSamplerWrapper(ClassBalancedBatches(30, 4, seed=11), shuffle=True, seed=100 + rank)
    epoch_per_rank = DistributedBatchSamplerWrapper(ClassBalancedBatches(30, 4, seed=11), shuffle=True)
    epoch_per_rank.set_epoch(int(rank == 0))  # rank 0 called set_epoch(1), the others did not
    for wrapper in (seed_per_rank, epoch_per_rank):
        next(iter(wrapper))
    pair = torch.distributed.new_group([1, 2])  # a collective: every rank makes it
    # Shares taken unevenly: every rank passing rank=0 (the other shares never trained), and two ranks of three
    # taking share 0 of 2. Every rank taking the whole sampler (num_replicas=1) takes each share equally often.
    shares = {
        "all_rank_0": DistributedBatchSamplerWrapper(ClassBalancedBatches(30, 4, seed=11), num_replicas=3, rank=0),
        "two_of_three": DistributedBatchSamplerWrapper(ClassBalancedBatches(30, 4, seed=11), 2, rank % 2),
        "whole_everywhere": DistributedBatchSamplerWrapper(ClassBalancedBatches(30, 4, seed=11), 1, 0),
    }
    for wrapper in shares.values():
        next(iter(wrapper))
    errors = {}
    calls: Dict[str, Callable[[], None]] = {
        "unseeded": lambda: verify_same_sequence(unseeded.head_digest),
        "seed_per_rank": lambda: verify_same_sequence(seed_per_rank.head_digest),
        "epoch_per_rank": lambda: verify_same_sequence(epoch_per_rank.head_digest),
        # ranks 1 and 2 compare within their group (and differ); rank 0, outside it, takes no part and passes
        "subgroup": lambda: verify_same_sequence(unseeded.head_digest, group=pair),
        "all_rank_0": lambda: verify_same_sequence(shares["all_rank_0"].head_digest),
        "two_of_three": lambda: verify_same_sequence(shares["two_of_three"].head_digest),
        "whole_everywhere": lambda: verify_same_sequence(shares["whole_everywhere"].head_digest),
        # rank 2 compares one sampler more than the others: the extra one must not go unchecked
        "count": lambda: verify_same_sequence(*[seeded.head_digest] * (1 + (rank == 2))),
        # rank 1 failed before it had digests: the others must raise at once, naming it, not wait for it
        "failure": lambda: (
            report_failure(ValueError("list is empty")) if rank == 1 else verify_same_sequence(seeded.head_digest)
        ),
    }
    for name, call in calls.items():
        try:
            call()
        except RuntimeError as error:
            errors[name] = str(error)
    return gathered, errors


@pytest.mark.parametrize(
    "taken,num_replicas,uneven",
    [
        ([0, 1, 2], 3, False),
        ([2, 0, 1], 3, False),
        ([0, 0, 0], 3, True),  # rank=0 everywhere
        ([0, 1, 0], 2, True),  # share 0 trained twice as often
        ([0, 0, 1, 1], 2, False),  # a data-parallel group of 2 inside 4 ranks
        ([0, 1, 1, 1], 2, True),
        ([0, 0], 1, False),  # every rank takes the whole sampler
        ([1, 2], 3, False),  # a subgroup of the 3 ranks that deal it: cannot tell
        ([1, 1], 3, False),  # (a data-parallel rank's model-parallel pair, say)
    ],
)
def test_shares_must_be_taken_equally_often_by_a_group_that_can_tell(
    taken: List[int], num_replicas: int, uneven: bool
) -> None:
    assert consistency._unevenly_taken(taken, num_replicas) is uneven


def test_a_rank_out_of_step_with_a_loader_that_is_not_dealt_is_told_so() -> None:
    """One rank in a loader's length check, another in an epoch's digest check (ranks with different loaders)."""
    not_dealt = SequenceDigest(NOT_DEALT_SOURCE, -1, NOT_DEALT, 0, 0)
    for pair in ((None, not_dealt), (not_dealt, None)):
        message = str(consistency._divergence_error(*pair, 1))
        assert message.startswith("the ranks are out of step: rank 0 and rank 1 compare different loaders"), message


def test_three_gloo_processes_with_workers_partition_each_epoch() -> None:
    results = run_distributed(_three_rank_epochs, 3)
    gathered, errors = results[0]
    unseeded_error = errors["unseeded"]
    assert "BatchSampler does not produce the same sequence" in unseeded_error
    assert "Seed the sampler identically on every rank" in unseeded_error
    assert "the ranks deal ClassBalancedBatches out with different options" in errors["seed_per_rank"]
    assert "seed=100, shuffle_window=None on rank 0 but" in errors["seed_per_rank"]
    assert "epoch 1 on rank 0 but 0 on rank 1" in errors["epoch_per_rank"], errors["epoch_per_rank"]
    assert "Call set_epoch(epoch) with the same epoch on every rank" in errors["epoch_per_rank"]
    every_rank = {"unseeded", "count", "seed_per_rank", "epoch_per_rank", "all_rank_0", "two_of_three"}
    assert errors["all_rank_0"].startswith(
        "the ranks deal ClassBalancedBatches among num_replicas=3 but take its shares unevenly: share 0 on rank(s) 0,"
        " 1, 2 (share(s) 1, 2 on none: never trained). Each rank must pass its own rank"
    ), errors["all_rank_0"]
    assert "share 0 on rank(s) 0, 2; share 1 on rank(s) 1." in errors["two_of_three"], errors["two_of_three"]
    for rank, (_, raised) in enumerate(results):
        expected = every_rank | ({"failure"} if rank != 1 else set()) | ({"subgroup"} if rank > 0 else set())
        assert raised.keys() == expected, (rank, raised)
        assert "rank 0 compared 1 digest(s) but rank 2 2" in raised["count"], raised["count"]
        if rank != 1:
            assert "rank 1 failed before it could compare" in raised["failure"], raised["failure"]
            assert "ValueError: list is empty" in raised["failure"], raised["failure"]
        if rank > 0:  # named by their global ranks, not by their places in the group
            assert "differ between rank 1 and rank 2" in raised["subgroup"], raised["subgroup"]
    for epoch in range(2):
        user = ClassBalancedBatches(30, 4, seed=11)
        user.set_epoch(epoch)
        expected = sorted(list(user))
        per_rank = [gathered[rank][epoch] for rank in range(3)]
        assert [len(share) for share in per_rank] == [3, 3, 3]  # 7 batches padded to 9
        dealt = [batch for share in per_rank for batch in share]
        assert all(batch in expected for batch in dealt)
        unique = {tuple(b) for b in dealt}
        assert unique == {tuple(b) for b in expected}  # every batch of the epoch was seen by some rank
        assert len(dealt) - len(unique) == 2  # the only repeats are the two padding batches
    assert gathered[0][0] != gathered[0][1]  # set_epoch reached the user's sampler


# ------------------------------------------------------------ options for default samplers, validation, empty data
class Positions(Dataset):
    """A map-style dataset of ``size`` items, each its own index."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def _shares(loader: DataLoader, world: int, **options: Any) -> List[List[Any]]:
    """Every rank's items (batches as lists) of one epoch, computed in this process."""
    patched = [patch_dataloader_to_ddp(loader, world, rank, **options) for rank in range(world)]
    return [[torch.as_tensor(item).tolist() for item in share] for share in patched]


def _torch_shares(size: int, world: int, shuffle: bool, seed: int = 0) -> List[List[int]]:
    return [list(DistributedSampler(Positions(size), world, rank, shuffle=shuffle, seed=seed)) for rank in range(world)]


def test_explicit_shuffle_wins_over_what_the_default_samplers_type_implies() -> None:
    sequential, shuffled = (
        DataLoader(Positions(10), batch_size=None),
        DataLoader(Positions(10), batch_size=None, shuffle=True),
    )
    assert _shares(sequential, 2, shuffle=True, seed=3) == _torch_shares(10, 2, shuffle=True, seed=3)
    assert _shares(shuffled, 2, shuffle=False) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert _shares(sequential, 2, shuffle=None) == _shares(sequential, 2) == _torch_shares(10, 2, shuffle=False)
    assert _shares(shuffled, 2, shuffle=None) == _shares(shuffled, 2) == _torch_shares(10, 2, shuffle=True)
    patched = patch_dataloader_to_ddp(DataLoader(Positions(10), batch_size=2), 2, 0, shuffle=True)
    assert isinstance(patched.sampler, DistributedSampler) and patched.sampler.shuffle
    uneven = patch_dataloader_to_ddp(sequential, 3, 0, shuffle=True, even_shares=False)  # the wrapper's branch too
    assert isinstance(uneven.sampler, DistributedSamplerWrapper) and uneven.sampler.shuffle
    # The loader's generator no longer drives the order: seed + epoch does, the same on every rank.
    for seed in (1, 2):
        drawn = DataLoader(Positions(10), batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(seed))
        assert _shares(drawn, 2) == _torch_shares(10, 2, shuffle=True)


def test_shuffle_window_deals_default_samplers_with_the_wrapper_over_their_positions() -> None:
    loader = DataLoader(Positions(12), batch_size=None, shuffle=True)
    patched = patch_dataloader_to_ddp(loader, 3, 0, shuffle_window=1, seed=4)
    assert isinstance(patched.sampler, DistributedSamplerWrapper) and type(patched.sampler.sampler) is SequentialSampler
    assert patched.sampler.shuffle and patched.sampler.shuffle_window == 1 and patched.sampler.seed == 4
    shares = _shares(loader, 3, shuffle_window=1, seed=4)
    expected = [
        DistributedSamplerWrapper(SequentialSampler(Positions(12)), 3, r, shuffle=True, shuffle_window=1, seed=4)
        for r in range(3)
    ]
    assert shares == [list(wrapper) for wrapper in expected]
    for window in range(4):  # positions are permuted only within windows of shuffle_window * 3 = 3
        assert sorted(share[window] for share in shares) == [3 * window, 3 * window + 1, 3 * window + 2]
    assert shares != [[r, r + 3, r + 6, r + 9] for r in range(3)]  # and they are permuted (seed 4)
    assert _shares(loader, 3, shuffle_window=1, shuffle=False) == [[r, r + 3, r + 6, r + 9] for r in range(3)]
    uneven = patch_dataloader_to_ddp(loader, 3, 0, shuffle_window=2, even_shares=False)
    assert isinstance(uneven.sampler, DistributedSamplerWrapper) and uneven.sampler.shuffle_window == 2
    with pytest.raises(ValueError, match="shuffle_window must be None or an integer >= 1, got 0"):
        patch_dataloader_to_ddp(loader, 3, 0, shuffle_window=0)


class _Relayed(ClassBalancedBatches):
    """A custom batch sampler (no BatchSampler subclass) that records the epochs it is told."""

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.told = epoch


SET_EPOCH_CASES: Dict[str, Callable[[], Tuple[DataLoader, Dict[str, Any]]]] = {
    "default-batched": lambda: (DataLoader(Squares(), batch_size=4, shuffle=True), {}),
    "default-window": lambda: (DataLoader(Squares(), batch_size=4, shuffle=True), {"shuffle_window": 2}),
    "default-unbatched": lambda: (DataLoader(Squares(), batch_size=None, shuffle=True), {}),
    "custom-index-sampler": lambda: (DataLoader(Squares(), batch_size=4, sampler=range(30)), {"shuffle": True}),
    "plain-batch-sampler": lambda: (
        DataLoader(Squares(), batch_sampler=BatchSampler(range(30), 4, False)),  # type: ignore[arg-type]
        {"shuffle": True},
    ),
    "custom-batch-sampler": lambda: (DataLoader(Squares(), batch_sampler=_Relayed(30, 4)), {"shuffle": True}),
}


@pytest.mark.parametrize("case", list(SET_EPOCH_CASES))
def test_documented_set_epoch_recipe_reaches_every_kind_of_returned_loader(case: str) -> None:
    """Docstring: set_epoch on loader.batch_sampler.sampler, or on loader.sampler without a batch sampler."""
    loader, options = SET_EPOCH_CASES[case]()
    epochs = []
    for epoch in range(2):
        patched = [patch_dataloader_to_ddp(loader, 2, rank, **options) for rank in range(2)]
        for share in patched:
            target = share.sampler if share.batch_sampler is None else share.batch_sampler.sampler  # type: ignore
            target.set_epoch(epoch)  # type: ignore[union-attr]
        shares = [[torch.as_tensor(item).reshape(-1).tolist() for item in share] for share in patched]
        epochs.append(shares)
        single = loader.batch_sampler or loader.sampler  # the single-process epoch (the user's sampler was told it)
        user = [torch.as_tensor(entry).reshape(-1).tolist() for entry in single]
        assert {i for share in shares for item in share for i in item} == {i for entry in user for i in entry}
    assert epochs[0] != epochs[1]  # the new epoch reached the shuffle
    if case == "custom-batch-sampler":
        assert loader.batch_sampler.told == 1  # type: ignore[union-attr]  # forwarded to the user's sampler


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


@pytest.mark.parametrize(
    "num_replicas,rank,message",
    [
        (0, 0, r"num_replicas must be an integer >= 1, got 0\."),
        (2, "x", r"rank must be an integer in \[0, 1\], got 'x'\."),
        (2, 2, r"rank must be an integer in \[0, 1\], got 2\."),
        (2.0, 0, r"num_replicas must be an integer >= 1, got 2\.0\."),
    ],
)
@pytest.mark.parametrize("kind", ["iterable-dataset", "already-sharded"])
def test_explicit_world_and_rank_are_validated_before_an_early_return(
    kind: str, num_replicas: Any, rank: Any, message: str
) -> None:
    if kind == "iterable-dataset":
        loader = DataLoader(_Stream())
    else:
        loader = DataLoader(Squares(), sampler=DistributedSampler(Squares(), num_replicas=2, rank=0))
    with pytest.raises(ValueError, match="patch_dataloader_to_ddp: " + message):
        patch_dataloader_to_ddp(loader, num_replicas, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the IterableDataset warning
        assert patch_dataloader_to_ddp(loader, 2, 0) is loader  # valid values: still returned unchanged


@pytest.mark.parametrize("num_replicas,rank", [(2, 1), (4, 0)])
def test_a_loader_sharded_for_other_ranks_than_those_given_is_refused(num_replicas: int, rank: int) -> None:
    """Returned unchanged, it would deal rank 0's share of 2 to whichever rank asked (or a half of the data to each
    of 4 ranks' quarters), silently."""
    samplers = (DistributedSampler(Squares(), num_replicas=2, rank=0), DistributedSamplerWrapper(range(30), 2, 0))
    for sharded_by in samplers:
        loader = DataLoader(Squares(), sampler=sharded_by)
        expected = rf"already sharded by its {type(sharded_by).__name__} for rank 0 of 2, not for the rank {rank} of"
        with pytest.raises(ValueError, match=expected):
            patch_dataloader_to_ddp(loader, num_replicas, rank)


@pytest.mark.parametrize(
    "options", [{}, {"pad": True}, {"pad": False}, {"even_shares": False}, {"shuffle_window": 1}, {"shuffle": True}]
)
@pytest.mark.parametrize("batch_size", [2, None])
def test_empty_dataset_under_a_default_sampler_is_refused_whatever_pad(options: Any, batch_size: Any) -> None:
    """pad=True used to give every rank 0 batches silently (DistributedSampler pads nothing with nothing)."""
    message = (
        r"^list is empty \(len\(\) == 0\): there is nothing to deal out among 3 ranks\. Check the dataset and the"
        r" sampler's arguments\.$"
    )
    with pytest.raises(ValueError, match=message):
        patch_dataloader_to_ddp(DataLoader([], batch_size=batch_size), 3, 0, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options,message",
    [
        ({"shuffle": "no"}, "shuffle must be True or False, got 'no'"),
        ({"pad": "no"}, "pad must be True or False, got 'no'"),
        ({"seed": 1.5}, "seed must be an integer in [-2**63, 2**63 - 1], got 1.5"),
        ({"seed": 2**64}, "seed must be an integer in [-2**63, 2**63 - 1], got"),
        ({"shuffle_window": 0}, "shuffle_window must be None or an integer >= 1, got 0"),
    ],
)
@pytest.mark.parametrize("custom", [False, True])
def test_options_of_the_wrong_type_are_refused_for_every_kind_of_loader(
    options: Dict[str, Any], message: str, custom: bool
) -> None:
    """Also for default samplers, which go to torch's DistributedSampler: it would read shuffle="no" as true."""
    loader = DataLoader(list(range(8)), batch_sampler=[[i] for i in range(8)]) if custom else DataLoader(range(8), 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        patch_dataloader_to_ddp(loader, 2, 0, **options)


def test_numpy_options_deal_a_default_sampler_as_python_ones_do() -> None:
    def share(**options: Any) -> List[List[int]]:
        return [batch.tolist() for batch in patch_dataloader_to_ddp(DataLoader(range(16), 2), 2, 0, **options)]

    assert share(shuffle=np.bool_(True), seed=np.int64(3)) == share(shuffle=True, seed=3) != share(shuffle=False)


class DictBatches(DataLoader):
    """A DataLoader subclass with an argument of its own (kept as an attribute) and an ``__iter__`` of its own."""

    def __init__(self, dataset: Any, key: str = "batch", **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.key = key

    def __iter__(self) -> Iterator[Any]:
        return ({self.key: batch} for batch in super().__iter__())


class ForgetsItsKey(DictBatches):
    """Its required argument is not kept: it cannot be built again."""

    def __init__(self, dataset: Any, secret: str, **kwargs: Any) -> None:
        super().__init__(dataset, key=secret.upper(), **kwargs)


class OwnOrder(DataLoader):
    """Makes its own sampler whatever it is given: built again, it would not be sharded."""

    def __init__(self, dataset: Any, batch_size: int = 1, **kwargs: Any) -> None:
        kwargs.update(sampler=SequentialSampler(dataset), batch_sampler=None)
        super().__init__(dataset, batch_size=batch_size, **kwargs)


@pytest.mark.parametrize("how", ["batch_sampler", "sampler", "default", "batched_sampler"])
def test_a_dataloader_subclass_keeps_its_class_its_arguments_and_its_iter(how: str) -> None:
    def options() -> Dict[str, Any]:  # fresh each time: a sampler's generator is consumed as it draws
        return {
            "batch_sampler": dict(batch_sampler=ClassBalancedBatches(30, 4)),
            "sampler": dict(
                sampler=WeightedRandomSampler([1.0] * 30, 30, generator=torch.Generator().manual_seed(0)), batch_size=4
            ),
            "default": dict(batch_size=4, shuffle=True),
            "batched_sampler": dict(sampler=BatchSampler(SequentialSampler(range(30)), 4, False), batch_size=None),
        }[how]

    loader = DictBatches(Squares(), key="x", collate_fn=collate_identity, **options())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt, so nothing to warn about
        patched = patch_dataloader_to_ddp(loader, num_replicas=2, rank=1)
    plain_loader = DataLoader(Squares(), collate_fn=collate_identity, **options())
    plain = patch_dataloader_to_ddp(plain_loader, num_replicas=2, rank=1)
    assert type(patched) is DictBatches and patched.key == "x" and patched.collate_fn is collate_identity
    assert [batch["x"] for batch in patched] == [list(batch) for batch in plain]  # the same share, its own __iter__


@pytest.mark.parametrize("cls", [DataLoader, DictBatches])
def test_a_loader_whose_workers_were_turned_off_after_construction_is_dealt(cls: type) -> None:
    """``loader.num_workers = 0`` (to debug in one process) leaves the settings of workers on the loader, which
    DataLoader refuses beside ``num_workers=0``: they are left at their defaults, and a subclass keeps its class."""
    loader = cls(Squares(), batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context="spawn")
    loader.num_workers = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patched = patch_dataloader_to_ddp(loader, num_replicas=2, rank=1)
    assert type(patched) is cls and patched.num_workers == 0
    assert (
        patched.prefetch_factor is None and not patched.persistent_workers and patched.multiprocessing_context is None
    )
    batches = [batch["batch"] if cls is DictBatches else batch for batch in patched]
    assert [batch.tolist() for batch in batches] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19, 21, 23], [25, 27, 29]]


class PositionalDataset(DictBatches):
    """Takes its dataset by position only, and DataLoader's other arguments by keyword."""

    def __init__(self, dataset: Any, /, **kwargs: Any) -> None:
        super().__init__(dataset, key="positional", **kwargs)


def test_a_subclass_taking_its_dataset_by_position_only_keeps_its_class() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # built again, so nothing to warn about
        patched = patch_dataloader_to_ddp(PositionalDataset(Squares(), batch_size=4), num_replicas=2, rank=0)
    assert type(patched) is PositionalDataset and isinstance(patched.sampler, DistributedSampler)
    assert [batch["positional"].tolist() for batch in patched][:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]


def test_a_map_datapipe_under_a_default_sampler_is_dealt_like_any_dataset() -> None:
    """DataLoader wraps a MapDataPipe for pickling but gives its default sampler the pipe itself: still a default
    sampler, dealt by a seeded DistributedSampler. Wrapped as a custom one, each rank's RandomSampler would draw
    its own permutation and the shares would overlap."""
    datapipes = pytest.importorskip("torch.utils.data.datapipes.map")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # datapipes are deprecated in torch
        loader = DataLoader(datapipes.SequenceWrapper(list(range(10))), batch_size=2, shuffle=True)
    assert loader.dataset is not loader.sampler.data_source  # the wrapping this is about
    shares = []
    for rank in range(2):
        torch.manual_seed(rank)  # ranks whose global generators differ
        patched = patch_dataloader_to_ddp(loader, num_replicas=2, rank=rank)
        assert isinstance(patched.sampler, DistributedSampler)
        shares.append([index for batch in patched for index in batch.tolist()])
    assert sorted(shares[0] + shares[1]) == list(range(10))


class Doubling(DataLoader):
    """Transforms a DataLoader argument on its way: built again from the result, it would double it again."""

    def __init__(self, dataset: Any, batch_size: int = 1, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=2 * batch_size, **kwargs)


class Scaled(DataLoader):
    """Keeps its own argument under another name: built again, it would fall back to its default."""

    def __init__(self, dataset: Any, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.factor = scale


class Fixed(DataLoader):
    """Takes only some of DataLoader's arguments: what is set on it afterwards would be lost."""

    def __init__(self, dataset: Any, batch_size: int = 1, sampler: Any = None) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler)


def _fixed_with_a_late_collate() -> DataLoader:
    loader = Fixed(Squares(), batch_size=4)
    loader.collate_fn = collate_identity
    return loader


@pytest.mark.parametrize(
    "make,why",
    [
        (
            lambda: ForgetsItsKey(Squares(), "k", batch_size=4),
            "its argument 'secret' is neither DataLoader's nor kept as an attribute",
        ),
        (lambda: OwnOrder(Squares(), batch_size=4), "it replaced the sharded sampler it was given"),
        (
            lambda: Doubling(Squares(), batch_size=2),
            "built again, its attribute 'batch_size' differs from the loader's",
        ),
        (lambda: Scaled(Squares(), scale=10.0, batch_size=4), "built again, its attribute 'factor' differs"),
        (_fixed_with_a_late_collate, "built again, its attribute 'collate_fn' differs from the loader's"),
    ],
    ids=["unrecoverable_argument", "own_sampler", "transformed_argument", "renamed_argument", "set_afterwards"],
)
def test_a_dataloader_subclass_that_cannot_be_built_again_becomes_a_plain_loader_with_a_warning(
    make: Callable[[], DataLoader], why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dataloader, "_warned", set())
    loader = make()
    expected = re.escape(f"could not be built again with the sharded sampler ({why}")
    with pytest.warns(UserWarning, match=expected) as record:
        patched = patch_dataloader_to_ddp(loader, num_replicas=2, rank=0)
    assert [warning.filename for warning in record] == [__file__]  # it points at the call, not into the package
    assert type(patched) is DataLoader and isinstance(patched.sampler, DistributedSampler)
    assert patched.collate_fn is loader.collate_fn  # the plain loader keeps what DataLoader's arguments say
    batches = [batch.tolist() if isinstance(batch, torch.Tensor) else list(batch) for batch in patched]
    assert batches == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18, 20, 22], [24, 26, 28]]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampling", ["custom_batches", "default_shuffled"])
def test_a_stateful_dataloader_stays_one_and_resumes_its_share_mid_epoch(num_workers: int, sampling: str) -> None:
    """Its own RandomSampler and BatchSampler (which it makes for shuffle=True) are defaults, dealt by a seeded
    DistributedSampler: taken for custom ones, each rank's unseeded permutation would overlap the others'."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    context = worker_context("lightning_ddp_ext", "pytest") if num_workers else None
    options: Dict[str, Any] = dict(batch_size=4, shuffle=True)
    if sampling == "custom_batches":
        options = dict(batch_sampler=ClassBalancedBatches(30, 4))

    def make(rank: int = 0) -> Any:
        loader = stateful.StatefulDataLoader(
            Squares(), snapshot_every_n_steps=2, num_workers=num_workers, multiprocessing_context=context, **options
        )
        patched = patch_dataloader_to_ddp(loader, num_replicas=2, rank=rank, shuffle=True, seed=4)
        assert type(patched) is stateful.StatefulDataLoader and patched.snapshot_every_n_steps == 2
        if sampling == "default_shuffled":
            assert type(patched.sampler) is DistributedSampler
        patched.batch_sampler.sampler.set_epoch(1)
        return patched

    whole = [batch.tolist() for batch in make()]
    if sampling == "default_shuffled":  # the two shares partition the dataset (pad: none needed, 30 = 2 x 15)
        other = [i for batch in make(rank=1) for i in batch.tolist()]
        assert sorted([i for batch in whole for i in batch] + other) == list(range(30))
    first = make()
    iterator = iter(first)
    head = [next(iterator).tolist() for _ in range(2)]
    state = first.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [batch.tolist() for batch in resumed] == whole


def test_a_subclass_made_in_a_lightning_dataloader_hook_keeps_its_class() -> None:
    """Lightning records how loaders made in its hooks were built, in attributes of their own (``__pl_*``,
    ``__dataset``): bookkeeping, not a difference between the loader and its rebuilt copy."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from lightning.fabric.utilities.data import _replace_dunder_methods

    with _replace_dunder_methods(DataLoader, "dataset"):  # what Lightning does around train_dataloader() & co
        loaders = [DictBatches(Squares(), key="x", batch_size=4), stateful.StatefulDataLoader(Squares(), batch_size=4)]
    for loader in loaders:
        assert any(name.startswith("__pl_") for name in vars(loader))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*could not be built again")  # torchdata warns of its own
            assert type(patch_dataloader_to_ddp(loader, num_replicas=2, rank=0)) is type(loader)

"""_loader_shares: finding the wrapper and sampler a loader deals with, share sizes, and what evaluation yielded.

Framework-free (no Lightning), so these also run on the lowest supported versions. The strategy's tests exercise
the same functions through real Trainer runs; these pin down each one on loaders built by hand.
"""
from __future__ import annotations

from typing import List

import pytest
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_ddp_ext._loader_shares import (
    distributed_sampler_share,
    epoch_sampler,
    fewest_exact_batches,
    index_sampler,
    items_in,
    record_yielded_in_evaluation,
    recorded_indices,
    samples_in_first_batches,
    wrapper_of,
)
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper, DistributedSamplerWrapper

#: Batches of varying size, as a token-budget sampler makes them.
UNEVEN_BATCHES = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]


def test_the_wrapper_is_found_as_batch_sampler_as_sampler_and_inside_a_plain_batch_sampler() -> None:
    batches = DistributedBatchSamplerWrapper(UNEVEN_BATCHES, num_replicas=2, rank=0)
    items = DistributedSamplerWrapper(range(8), num_replicas=2, rank=0)
    assert wrapper_of(DataLoader(range(11), batch_sampler=batches)) is batches
    assert wrapper_of(DataLoader(range(8), sampler=items, batch_size=2)) is items
    plain = BatchSampler(items, batch_size=2, drop_last=False)
    assert wrapper_of(DataLoader(range(8), batch_sampler=plain)) is items
    assert index_sampler(DataLoader(range(8), batch_sampler=plain)) is items
    assert wrapper_of(DataLoader(range(8), sampler=items, batch_size=None)) is items


def test_a_batch_sampler_of_another_kind_hides_what_it_draws_from() -> None:
    """Only torch's plain BatchSampler is looked into: a subclass may draw otherwise, so its sampler is not ours."""

    class OwnBatches(BatchSampler):
        pass

    items = DistributedSamplerWrapper(range(8), num_replicas=2, rank=0)
    loader = DataLoader(range(8), batch_sampler=OwnBatches(items, batch_size=2, drop_last=False))
    assert wrapper_of(loader) is None
    assert epoch_sampler(loader) is None


def test_the_epoch_sampler_is_ours_or_torch_s_distributed_sampler_and_nothing_else() -> None:
    torch_sampler = DistributedSampler(range(8), num_replicas=2, rank=1)
    assert epoch_sampler(DataLoader(range(8), sampler=torch_sampler, batch_size=2)) is torch_sampler
    assert wrapper_of(DataLoader(range(8), sampler=torch_sampler, batch_size=2)) is None
    assert epoch_sampler(DataLoader(range(8), batch_size=2)) is None
    assert isinstance(index_sampler(DataLoader(range(8), batch_size=2)), SequentialSampler)


@pytest.mark.parametrize(
    "batch_size,drop_last,expected",
    [(None, False, 3), (2, False, 2), (2, True, 1), (3, False, 1), (4, True, 0)],
)
def test_the_fewest_exact_batches_are_those_of_the_last_rank(
    batch_size: int, drop_last: bool, expected: int
) -> None:
    """10 samples among 3 ranks unevenly: ranks 0, 1, 2 take 4, 3, 3; rank 2's share batched as the loader does."""
    shares = [DistributedSamplerWrapper(range(10), num_replicas=3, rank=r, even_shares=False) for r in range(3)]
    loaders = [DataLoader(range(10), sampler=s, batch_size=batch_size, drop_last=drop_last) for s in shares]
    assert fewest_exact_batches(loaders[0], shares[0]) == expected
    assert min(len(loader) for loader in loaders) == expected  # what the ranks really get


def test_the_fewest_exact_batches_of_a_batch_sampler_count_whole_batches() -> None:
    shares = [
        DistributedBatchSamplerWrapper(UNEVEN_BATCHES, num_replicas=3, rank=r, even_shares=False) for r in range(3)
    ]
    assert [len(list(share)) for share in shares] == [2, 2, 1]
    loader = DataLoader(range(11), batch_sampler=shares[0])
    assert fewest_exact_batches(loader, shares[0]) == 1


def test_items_in_the_first_batches_stop_at_the_share() -> None:
    share = DistributedSamplerWrapper(range(10), num_replicas=2, rank=0)  # 5 items
    loader = DataLoader(range(10), sampler=share, batch_size=2)
    assert [items_in(n, loader, share) for n in range(4)] == [0, 2, 4, 5]


@pytest.mark.parametrize("rank,expected", [(0, [0, 3, 6, 9]), (1, [1, 4, 7]), (2, [2, 5, 8])])
def test_a_distributed_sampler_s_share_leaves_its_padding_out(rank: int, expected: List[int]) -> None:
    sampler = DistributedSampler(range(10), num_replicas=3, rank=rank, shuffle=False)
    assert len(list(sampler)) == 4  # padded to 12 in all
    assert distributed_sampler_share(sampler) == expected


def _evaluated(wrapper: DistributedBatchSamplerWrapper, loader: DataLoader) -> List[List[int]]:
    record_yielded_in_evaluation(wrapper, training=False)
    return [batch.tolist() for batch in loader]


@pytest.mark.parametrize(
    "rank,batches,indices,first_two",
    [(0, [[0, 1, 2], [4, 5], [10]], [0, 1, 2, 4, 5, 10], 5), (1, [[3], [6, 7, 8, 9], [0, 1, 2]], [3, 6, 7, 8, 9], 5)],
)
def test_recorded_indices_and_samples_follow_the_batches_evaluated(
    rank: int, batches: List[List[int]], indices: List[int], first_two: int
) -> None:
    """Rank 1's last batch pads the round (a repeat of batch 0): counted as evaluated, not as an index."""
    wrapper = DistributedBatchSamplerWrapper(UNEVEN_BATCHES, num_replicas=2, rank=rank)
    loader = DataLoader(range(11), batch_sampler=wrapper)
    assert _evaluated(wrapper, loader) == batches
    assert recorded_indices(wrapper) == indices
    assert samples_in_first_batches(loader, 2) == first_two
    assert samples_in_first_batches(loader, 3) == sum(map(len, batches))


def test_a_wrapper_that_served_training_never_records() -> None:
    """Training wins, whichever was set up first: a training epoch's share may be too large to keep."""
    wrapper = DistributedSamplerWrapper(range(10), num_replicas=2, rank=0)
    record_yielded_in_evaluation(wrapper, training=True)
    assert not wrapper.record_yielded
    record_yielded_in_evaluation(wrapper, training=False)
    assert not wrapper.record_yielded
    other = DistributedSamplerWrapper(range(10), num_replicas=2, rank=0)
    record_yielded_in_evaluation(other, training=False)
    assert other.record_yielded
    loader = DataLoader(range(10), sampler=other, batch_size=4)
    assert [len(batch) for batch in loader] == [4, 1]
    assert recorded_indices(other) == [0, 2, 4, 6, 8]
    assert samples_in_first_batches(loader, 1) == 4

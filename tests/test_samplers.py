"""Sharding math of the sampler wrappers: every rank's share computed in one process."""
from __future__ import annotations

import copy
import functools
import gc
import math
import pickle
import re
import subprocess
import sys
import weakref
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, WeightedRandomSampler

from lightning_ddp_ext import _store
from lightning_ddp_ext._windows import (
    PlanSpan,
    numpy_window_plan,
    plan_ranges,
    python_window_plan,
    sampled_block_ends,
    window_permutations,
)
from lightning_ddp_ext.samplers import (
    DistributedBatchSamplerWrapper,
    DistributedSamplerWrapper,
    LengthMismatchError,
    _EPOCHS_FORWARDED,
    _epoch_forwarded_to,
    _serial_randperm,
)


class VariableBatches:
    """A token-budget-like batch sampler: batches of varying sizes, subclassing nothing, with set_epoch."""

    def __init__(self, num_batches: int) -> None:
        self.num_batches = num_batches
        self.epochs_seen: List[int] = []

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.epochs_seen.append(epoch)

    def __iter__(self) -> Iterator[List[int]]:
        start = 0
        for b in range(self.num_batches):
            size = 1 + (b * 7) % 5
            yield list(range(start, start + size))
            start += size


def shares(
    source: Any, world: int, cls: type = DistributedBatchSamplerWrapper, epoch: int = 0, **options: Any
) -> List[List[Any]]:
    result = []
    for rank in range(world):
        wrapper = cls(source, num_replicas=world, rank=rank, **options)
        wrapper.set_epoch(epoch)
        result.append(list(wrapper))
    return result


def as_key(batch: Any) -> Any:
    return tuple(batch) if isinstance(batch, list) else batch


modes = st.sampled_from([(False, None), (True, None), (True, 1), (True, 3)])


@settings(max_examples=150, deadline=None)
@given(
    num_batches=st.integers(1, 60),
    world=st.integers(1, 8),
    pad=st.booleans(),
    mode=modes,
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**31),
)
def test_shares_partition_the_sequence(
    num_batches: int, world: int, pad: bool, mode: tuple[bool, Optional[int]], epoch: int, seed: int
) -> None:
    shuffle, window = mode
    source = VariableBatches(num_batches)
    sequence = [tuple(b) for b in source]
    if not pad and num_batches < world:
        with pytest.raises(ValueError, match="pad=False"):
            DistributedBatchSamplerWrapper(source, world, 0, pad=False)
        return
    per_rank = math.ceil(num_batches / world) if pad else num_batches // world
    result = shares(source, world, epoch=epoch, shuffle=shuffle, shuffle_window=window, seed=seed, pad=pad)

    # equal counts, and len() says so
    assert [len(share) for share in result] == [per_rank] * world
    assert len(DistributedBatchSamplerWrapper(source, world, 0, pad=pad)) == per_rank
    dealt = Counter(as_key(batch) for share in result for batch in share)
    # batch contents unchanged: every dealt batch is one of the user's batches
    assert set(dealt) <= set(sequence)
    if pad:
        # every batch at least once; extra copies are only padding, repeated from the start of the sequence
        assert set(dealt) == set(sequence)
        extra = sum(dealt.values()) - num_batches
        assert extra == per_rank * world - num_batches
        expected_repeats = Counter(sequence[i % num_batches] for i in range(extra))
        assert dealt - Counter(sequence) == expected_repeats
    else:
        assert all(count == 1 for count in dealt.values())
        if not shuffle:
            assert set(dealt) == set(sequence[: per_rank * world])
    if not shuffle:
        for rank, share in enumerate(result):
            padded = sequence + [sequence[i % num_batches] for i in range(per_rank * world - num_batches)]
            assert [tuple(b) for b in share] == padded[: per_rank * world][rank::world]
    # determinism: the same arguments give the same shares
    assert result == shares(source, world, epoch=epoch, shuffle=shuffle, shuffle_window=window, seed=seed, pad=pad)


@pytest.mark.parametrize("window", [None, 2])
def test_shuffle_depends_on_epoch_and_seed(window: Optional[int]) -> None:
    source = VariableBatches(200)
    base = shares(source, 2, epoch=0, shuffle=True, shuffle_window=window, seed=3)
    assert shares(source, 2, epoch=1, shuffle=True, shuffle_window=window, seed=3) != base
    assert shares(source, 2, epoch=0, shuffle=True, shuffle_window=window, seed=4) != base
    # seed + epoch is what matters, as with DistributedSampler
    assert shares(source, 2, epoch=1, shuffle=True, shuffle_window=window, seed=2) == base


def test_windowed_shuffle_permutes_within_windows_only() -> None:
    world, window = 2, 3
    result = shares(VariableBatches(60), world, shuffle=True, shuffle_window=window, seed=0)
    sequence = [tuple(b) for b in VariableBatches(60)]
    span = world * window
    for rank, share in enumerate(result):
        for k, batch in enumerate(share):
            position = sequence.index(tuple(batch))
            assert position // span == k // window  # k-th own batch comes from window k // window


@pytest.mark.parametrize("build", ["compiled", "python"])
@pytest.mark.parametrize(
    "num_batches,world,window",
    [(20, 3, None), (20, 3, 1), (20, 3, 3), (1201, 2, 200)],  # the last: the last window is planned in numpy
)
def test_shuffled_pad_false_drops_batches_the_shuffle_draws(
    num_batches: int, world: int, window: Optional[int], build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pad=False with shuffling drops len % W batches drawn by the shuffle, anew each epoch, as
    DistributedSampler(shuffle=True, drop_last=True) does: not always the sampler's last ones, which a
    deterministic sampler (length buckets, a curriculum) would then never train on. With a window they come
    from the last window, which the cut tail joins."""
    if build == "compiled" and _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    if build == "python":
        monkeypatch.setattr(_store, "_compact", None)
    source = VariableBatches(num_batches)
    sequence = [tuple(b) for b in source]
    total = num_batches // world * world
    span = world * window if window else num_batches
    last_window_start = (total - 1) // span * span
    dropped_per_epoch = []
    for epoch in range(8):
        result = shares(source, world, epoch=epoch, shuffle=True, shuffle_window=window, pad=False)
        dealt = Counter(as_key(batch) for share in result for batch in share)
        assert all(count == 1 for count in dealt.values()) and sum(dealt.values()) == total
        dropped = {sequence.index(batch) for batch in set(sequence) - set(dealt)}
        assert len(dropped) == num_batches - total and min(dropped) >= last_window_start
        dropped_per_epoch.append(frozenset(dropped))
    assert len(set(dropped_per_epoch)) > 1  # a tail always cut would be the same every epoch


def fisher_yates(seed: int, window: int, size: int, stride: int) -> List[int]:
    """The windowed shuffle's permutation of one window, written out one draw at a time in plain Python."""

    def mix(counter: int) -> int:  # SplitMix64's output function, modulo 2**64
        z = (counter + 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    permutation = list(range(size))
    for i in range(size - 1, 0, -1):
        j = (mix(seed + window * stride + i) >> 32) * (i + 1) >> 32
        permutation[i], permutation[j] = permutation[j], permutation[i]
    return permutation


@pytest.mark.parametrize("build", ["compiled", "python"])
def test_window_permutations_are_uniform_and_fixed(build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The windowed shuffle's permutations: integer arithmetic only, so every machine and every release draws
    the same (a resumed run deals as the interrupted one did), and each position is equally likely to land
    anywhere (a Fisher-Yates off by one, Sattolo's variant, would never leave an item in place). Computed by
    the C helper where it is built, by numpy otherwise: both must hold."""
    if build == "compiled" and _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    if build == "python":
        monkeypatch.setattr(_store, "_compact", None)
    assert window_permutations(0, 0, 2, 8, 8).tolist() == [[7, 4, 1, 0, 6, 2, 5, 3], [5, 3, 0, 1, 6, 7, 2, 4]]
    assert window_permutations(0, 1, 1, 8, 8).tolist() == [[5, 3, 0, 1, 6, 7, 2, 4]]  # any window on its own
    for seed, first, size, stride in ((0, 0, 32, 32), (2**63 - 2, 10**9, 20, 32), (12345, 7, 1, 1)):
        expected = [fisher_yates(seed, window, size, stride) for window in range(first, first + 3)]
        assert window_permutations(seed, first, 3, size, stride).tolist() == expected
    permutations = window_permutations(2**63 - 2, 10, 40_000, 8, 8)
    assert (np.sort(permutations, axis=1) == np.arange(8)).all()
    counts = np.zeros((8, 8), dtype=np.int64)  # counts[i, p]: how often position i holds item p
    np.add.at(counts, (np.tile(np.arange(8), 40_000), permutations.reshape(-1)), 1)
    assert np.abs(counts - 5_000).max() < 5 * np.sqrt(5_000)  # five standard deviations: a bias fails at once
    assert len({tuple(row) for row in permutations[:5_000].tolist()}) > 4_600  # 8! = 40,320 are possible


def test_plan_ranges_set_the_head_and_the_last_window_apart() -> None:
    """The first window, the rest of the head's windows, then 8, 64, ... windows (up to 65,536 positions), then
    the last window alone: the C helper deals every range between the head and the last window."""
    assert list(plan_ranges(1, 32, 2)) == [(0, 1)]
    assert list(plan_ranges(2, 32, 1)) == [(0, 1), (1, 2)]
    assert list(plan_ranges(3, 32, 5)) == [(0, 3)]  # the head covers the epoch
    assert list(plan_ranges(100, 32, 2)) == [(0, 2), (2, 10), (10, 74), (74, 99), (99, 100)]
    assert list(plan_ranges(100, 128, 1)) == [(0, 1), (1, 9), (9, 73), (73, 99), (99, 100)]
    assert list(plan_ranges(5000, 32, 2))[3:] == [(74, 586), (586, 2634), (2634, 4682), (4682, 4999), (4999, 5000)]


def test_the_digest_samples_every_few_blocks_and_the_last() -> None:
    """Blocks end (one past their last window) at first + 8, first + 16, ..., end; every fourth is sampled."""
    assert sampled_block_ends(0, 20, 8, 1) == [8, 16, 20]
    assert sampled_block_ends(1, 73, 8, 4) == [33, 65, 73]
    assert sampled_block_ends(0, 3, 8, 4) == [3]
    assert sampled_block_ends(0, 64, 8, 4) == [32, 64]


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(1, 8),
    per_rank=st.integers(1, 24),
    length=st.integers(1, 3000),
    pad=st.booleans(),
    windows_per_block=st.integers(1, 12),
    blocks_per_sample=st.integers(1, 4),
    data=st.data(),
)
def test_plans_in_python_and_in_numpy_agree(
    world: int, per_rank: int, length: int, pad: bool, windows_per_block: int, blocks_per_sample: int, data: Any
) -> None:
    """A plan of a few positions is made in plain Python, a longer one in numpy (see window_plan), so the
    wrappers' tests mostly run one of them on any one epoch: both must read, keep and order alike for any
    range of windows, partial last windows and padding included."""
    if not pad and length < world:
        return
    window = per_rank * world
    total = -(-length // world) * world if pad else length // world * world
    windows = -(-total // window)
    first = data.draw(st.integers(0, windows - 1), label="first")
    end = data.draw(st.integers(first + 1, min(windows, first + 40)), label="end")
    rank = data.draw(st.integers(0, world - 1), label="rank")
    seed = data.draw(st.integers(0, 2**63 - 1), label="seed")
    head_end = max(64, total - length)
    span = PlanSpan(
        seed, first, end, window, total, length, windows_per_block, blocks_per_sample, head_end, world, rank
    )
    in_python, in_numpy = python_window_plan(span), numpy_window_plan(span)
    assert in_python.mask == in_numpy.mask
    assert in_python.order.tolist() == in_numpy.order.tolist()
    assert in_python.blocks == in_numpy.blocks


@settings(max_examples=60, deadline=None)
@given(num=st.integers(1, 50), world=st.integers(1, 5), pad=st.booleans(), mode=modes, epoch=st.integers(0, 3))
def test_index_wrapper_gives_disjoint_shares(
    num: int, world: int, pad: bool, mode: tuple[bool, Optional[int]], epoch: int
) -> None:
    shuffle, window = mode
    if not pad and num < world:
        return
    result = shares(
        range(100, 100 + num), world, DistributedSamplerWrapper, epoch, shuffle=shuffle, shuffle_window=window, pad=pad
    )
    flat = [i for share in result for i in share]
    assert all(isinstance(i, int) for i in flat)
    assert len({len(s) for s in result}) == 1
    if pad:
        assert set(flat) == set(range(100, 100 + num))
        assert len(flat) == math.ceil(num / world) * world
    else:
        assert len(flat) == len(set(flat)) == num // world * world


def test_set_epoch_is_forwarded_to_sampler_and_its_inner_sampler() -> None:
    class Inner:
        def __init__(self) -> None:
            self.epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self) -> Iterator[int]:
            return iter(range(8))

        def __len__(self) -> int:
            return 8

    source = VariableBatches(4)
    wrapper = DistributedBatchSamplerWrapper(source, 2, 0)
    wrapper.sampler.set_epoch(3)  # the path Lightning's loops take: loader.batch_sampler.sampler.set_epoch
    assert wrapper.epoch == 3 and source.epochs_seen == [3]
    wrapper.set_epoch(3)  # set again (Lightning's loop does, before each validation run): forwarded again
    wrapper._set_epoch_ahead_of_loop(4)  # a strategy sets it before the loop does: the loop's call is not forwarded
    wrapper.set_epoch(4)
    wrapper.set_epoch(4)
    wrapper._set_epoch_ahead_of_loop(5)
    wrapper.set_epoch(6)  # not the announced epoch: forwarded
    assert wrapper.epoch == 6 and source.epochs_seen == [3, 3, 4, 4, 5, 6]
    batch_sampler = BatchSampler(Inner(), 2, False)  # type: ignore[arg-type]
    DistributedBatchSamplerWrapper(batch_sampler, 2, 1).set_epoch(5)
    assert batch_sampler.sampler.epoch == 5  # type: ignore[attr-defined]


def test_set_epoch_takes_numpy_and_torch_integers_and_refuses_the_rest() -> None:
    """A numpy epoch failed at the next shuffle, in torch's words ("an integer is required"), naming nothing."""
    wrapper = DistributedBatchSamplerWrapper(VariableBatches(4), 2, 0, shuffle=True, seed=np.int64(1))
    for epoch in (np.int64(2), torch.tensor(2)):
        wrapper.set_epoch(epoch)  # type: ignore[arg-type]
        assert type(wrapper.epoch) is int and list(wrapper) == list(
            DistributedBatchSamplerWrapper(VariableBatches(4), 2, 0, shuffle=True, seed=3)
        )
    for bad in (2.0, "2", None, True):
        with pytest.raises(TypeError, match=re.escape(f"set_epoch takes an integer epoch, got {bad!r}")):
            wrapper.set_epoch(bad)  # type: ignore[arg-type]


def test_a_shallow_copy_relays_epochs_to_itself() -> None:
    original = DistributedBatchSamplerWrapper(VariableBatches(4), 2, 0, shuffle=True)
    clone = copy.copy(original)
    clone.sampler.set_epoch(2)
    assert (original.epoch, clone.epoch) == (0, 2) and clone.batch_sampler is original.batch_sampler
    assert list(clone) == list(DistributedBatchSamplerWrapper(VariableBatches(4), 2, 0, shuffle=True, seed=2))


def test_the_users_data_attributes_are_read_and_set_through_the_wrapper() -> None:
    """As on one device, where the loader holds the user's object: a callback raising a curriculum's ``limit``."""
    source = VariableBatches(6)
    source.seed = 5  # type: ignore[attr-defined]
    wrapper = DistributedBatchSamplerWrapper(source, 2, 0)
    wrapper.num_batches = 4  # type: ignore[attr-defined]
    assert source.num_batches == 4 and wrapper.num_batches == 4 and len(wrapper) == 2  # type: ignore[attr-defined]
    assert "num_batches" not in vars(wrapper)
    wrapper.seed = 7  # the wrapper's own settings stay its own, whatever the user's object has
    assert (wrapper.seed, source.seed) == (7, 5)  # type: ignore[attr-defined]
    wrapper.note = "new"  # type: ignore[attr-defined]  # a name the user's object lacks: the wrapper's
    assert not hasattr(source, "note")
    plain = DistributedBatchSamplerWrapper(BatchSampler(SequentialSampler(range(10)), 3, False), 2, 0)
    # Lightning rebuilds a batch sampler that has both around a sampler of its own: a wrapper must not look like one.
    assert not hasattr(plain, "batch_size") and not hasattr(plain, "drop_last")
    assert not hasattr(plain, "__pl_saved_args") and not hasattr(plain, "state_dict")
    restored = pickle.loads(pickle.dumps(wrapper))
    assert restored.num_batches == 4 and copy.deepcopy(wrapper).num_batches == 4  # type: ignore[attr-defined]


class _Buckets(VariableBatches):
    """Bucket boundaries computed once, on first use (``functools.cached_property``)."""

    @functools.cached_property
    def boundaries(self) -> List[int]:
        return [8, 16, 32]


def test_a_cached_property_of_the_users_object_is_read_and_set_through_the_wrapper() -> None:
    """It was taken for a method: read through the wrapper it failed until the user's object had computed it, and
    set through the wrapper it landed on the wrapper, changing nothing, silently."""
    source = _Buckets(4)
    wrapper = DistributedBatchSamplerWrapper(source, 2, 0)
    assert wrapper.boundaries == [8, 16, 32]  # type: ignore[attr-defined]
    wrapper.boundaries = [4, 8]  # type: ignore[attr-defined]
    assert source.boundaries == [4, 8] and "boundaries" not in vars(wrapper)


def test_the_users_inner_sampler_is_reached_through_the_relay_and_batch_size_is_not_set_silently() -> None:
    """A hard-negative callback written for one device sets ``batch_sampler.sampler.weights``; a batch-size
    curriculum sets ``batch_sampler.batch_size``. Neither may change nothing without an error."""
    inner = WeightedRandomSampler(torch.ones(8), 8, generator=torch.Generator().manual_seed(0))
    users = BatchSampler(inner, 2, False)
    wrapper = DistributedBatchSamplerWrapper(_HardNegatives(users), 2, 0)
    wrapper.sampler.weights = torch.arange(8.0)
    assert torch.equal(inner.weights, torch.arange(8.0)) and wrapper.sampler.num_samples == 8
    assert "weights" not in dir(type(wrapper.sampler))
    for name in ("batch_size", "drop_last"):
        with pytest.raises(
            AttributeError, match=rf"cannot set '{name}' on DistributedBatchSamplerWrapper: .*wrapper.source.{name}"
        ):
            setattr(wrapper, name, 4)
        with pytest.raises(AttributeError, match=rf"Reach it on your object itself, wrapper.source.{name}"):
            getattr(wrapper, name)
    assert not hasattr(wrapper, "batch_size") and wrapper.source.batch_size == 2
    without = DistributedBatchSamplerWrapper(VariableBatches(4), 2, 0)
    with pytest.raises(AttributeError, match="VariableBatches has no sampler attribute, so there is no 'weights'"):
        without.sampler.weights = 1
    assert not hasattr(without.sampler, "weights") and callable(without.sampler.set_epoch)
    # Replacing the inner sampler (re-mined negatives): it replaced the relay, so the user's batches kept the old
    # sampler and the loop's set_epoch no longer reached the wrapper, both silently.
    plain_users = BatchSampler(SequentialSampler(range(8)), 2, False)
    plain = DistributedBatchSamplerWrapper(plain_users, 2, 0)
    relay, mined = plain.sampler, SequentialSampler(range(4))
    plain.sampler = mined
    assert plain_users.sampler is mined and plain.sampler is relay
    plain.sampler.set_epoch(2)
    assert plain.epoch == 2 and list(plain) == [[0, 1]]
    with pytest.raises(AttributeError, match="VariableBatches has no sampler attribute, so there is no 'sampler'"):
        without.sampler = mined
    for copied in (copy.copy(wrapper), copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper))):
        copied.sampler.set_epoch(3)
        assert copied.epoch == 3 and wrapper.epoch == 0


class _Resizable(DistributedBatchSamplerWrapper):
    """A wrapper subclass that owns a batch_size: its own attribute is set, not refused."""

    def __init__(self, source: Any) -> None:
        super().__init__(source, 2, 0)
        self.batch_size = 4


def test_a_wrapper_subclass_sets_its_own_batch_size_and_the_relay_pickles_under_every_protocol() -> None:
    wrapper = _Resizable(_HardNegatives(BatchSampler(SequentialSampler(range(8)), 2, False)))
    wrapper.batch_size = 8
    assert wrapper.batch_size == 8 and wrapper.source.batch_size == 2
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        restored = pickle.loads(pickle.dumps(wrapper, protocol=protocol))
        assert restored.sampler._wrapper is restored, protocol
    assert weakref.ref(wrapper.sampler)() is wrapper.sampler


class _HardNegatives:
    """A batch sampler over a weighted sampler, subclassing nothing."""

    def __init__(self, users: BatchSampler) -> None:
        self.users, self.sampler, self.batch_size, self.drop_last = users, users.sampler, users.batch_size, False

    def __len__(self) -> int:
        return len(self.users)

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self.users)


class _Slotted:
    __slots__ = ("cap", "_level")

    def __init__(self) -> None:
        self.cap, self._level = 4, 1

    @property
    def level(self) -> int:
        return self._level

    @level.setter
    def level(self, value: int) -> None:
        self._level = value

    def __len__(self) -> int:
        return self.cap

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.cap))


class _Subclassed(DistributedSamplerWrapper):
    """A subclass setting attributes of its own, some named like the user's sampler's."""

    def __init__(self, sampler: Any) -> None:
        super().__init__(sampler, 2, 0)
        self.cap = "the subclass's own"
        self.generator = None


def test_slots_and_properties_are_set_through_and_a_subclass_keeps_its_own_attributes() -> None:
    source = _Slotted()
    wrapper = DistributedSamplerWrapper(source, 2, 0)
    wrapper.cap, wrapper.level = 6, 3  # type: ignore[attr-defined]
    assert (source.cap, source.level, wrapper.level, len(wrapper)) == (6, 3, 3, 3)  # type: ignore[attr-defined]
    assert "cap" not in vars(wrapper) and "level" not in vars(wrapper)
    user = RandomSampler(range(10), generator=torch.Generator().manual_seed(1))
    subclassed = _Subclassed(user)
    assert subclassed.generator is None and user.generator is not None
    sized = _Slotted()
    assert _Subclassed(sized).cap == "the subclass's own" and sized.cap == 4


class _ClassDefault:
    limit = 10  # a class-level default, never set on the instance

    def __len__(self) -> int:
        return 4

    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class _NoneOnTheClass(DistributedSamplerWrapper):
    limit = None  # the subclass's own attribute, though None


def _raise_limit(self: Any) -> None:  # a plain function whose parameter happens to be called self
    self.limit = 20


def test_class_defaults_and_helpers_named_self_reach_the_users_object() -> None:
    source = _ClassDefault()
    wrapper = DistributedSamplerWrapper(source, 2, 0)
    assert wrapper.limit == 10  # type: ignore[attr-defined]
    _raise_limit(wrapper)
    assert source.limit == 20 and "limit" not in vars(wrapper)
    own = _NoneOnTheClass(_ClassDefault(), 2, 0)
    own.limit = 5  # type: ignore[assignment]
    assert own.limit == 5 and own.source.limit == 10  # type: ignore[attr-defined]


def test_an_index_sampler_yielding_keys_is_told_to_yield_positions() -> None:
    """A map-style dataset may be keyed by strings; the wrappers deal integer indices, and say so."""
    with pytest.raises(
        TypeError, match=r"yielded 'a' \(str\) at position 0; .* dealt by position: let the sampler yield"
    ):
        list(DistributedSamplerWrapper(["a", "b", "c", "d"], 2, 0))


def test_user_object_is_not_mutated_or_rebuilt() -> None:
    source = BatchSampler(SequentialSampler(range(10)), 3, False)
    before = dict(vars(source))
    wrapper = DistributedBatchSamplerWrapper(source, 2, 0, shuffle=True)
    list(wrapper)
    assert wrapper.batch_sampler is source and vars(source) == before


def test_streaming_reads_only_the_head_before_the_first_batch() -> None:
    """However long the epoch, the first batch comes after a bounded read: the head that the first consistency
    check compares, 64 items (with a window, the whole windows that hold them)."""
    reads: List[int] = []

    class Counting:
        def __len__(self) -> int:
            return 10**9

        def __iter__(self) -> Iterator[List[int]]:
            for i in range(10**9):
                reads.append(i)
                yield [i]

    first = next(iter(DistributedBatchSamplerWrapper(Counting(), 4, 2)))
    assert first == [2] and len(reads) == 64
    reads.clear()
    next(iter(DistributedBatchSamplerWrapper(Counting(), 4, 1, shuffle=True, shuffle_window=8)))
    assert len(reads) == 64
    reads.clear()
    next(iter(DistributedBatchSamplerWrapper(Counting(), 4, 1, shuffle=True, shuffle_window=20)))
    assert len(reads) == 80  # one window holds the head


# --------------------------------------------------------------------------- bad input


class Sized:
    def __init__(self, declared: int, actual: int, make: Any = lambda i: [i]) -> None:
        self.declared, self.actual, self.make = declared, actual, make

    def __len__(self) -> int:
        return self.declared

    def __iter__(self) -> Iterator[Any]:
        return (self.make(i) for i in range(self.actual))


@pytest.mark.parametrize("options", [{}, {"shuffle": True}, {"shuffle": True, "shuffle_window": 2}, {"pad": False}])
def test_a_sampler_that_never_ends_fails_instead_of_hanging(options: dict) -> None:
    """Checking that the sampler ended reads at most len() more items: an endless one must not hang the rank."""
    endless = Sized(10, 10**12)  # a generator: nothing is made until read
    with pytest.raises(LengthMismatchError, match="returned 10 but iterating it produced more than 20 item"):
        list(DistributedBatchSamplerWrapper(endless, 3, 1, **options))


def test_missing_len_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="__len__"):
        DistributedBatchSamplerWrapper((b for b in [[0]]), 2, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("declared,actual", [(10, 7), (7, 10), (9, 8)])
@pytest.mark.parametrize("options", [{}, {"shuffle": True}, {"shuffle": True, "shuffle_window": 2}, {"pad": False}])
def test_wrong_len_raises_with_both_numbers_and_equal_counts(declared: int, actual: int, options: dict) -> None:
    yielded = []
    for rank in range(3):
        wrapper = DistributedBatchSamplerWrapper(Sized(declared, actual), 3, rank, **options)
        got: List[Any] = []
        with pytest.raises(LengthMismatchError, match=rf"returned {declared} but iterating it produced {actual}"):
            for batch in wrapper:
                got.append(batch)
        yielded.append(len(got))
    assert len(set(yielded)) == 1, f"ranks yielded different counts before failing: {yielded}"


@pytest.mark.parametrize("window", [0, -1, 1.5, True, 2**30 + 1])
def test_bad_shuffle_window_is_refused(window: Any) -> None:
    expected = "makes windows of 2147483650 positions" if window == 2**30 + 1 else "shuffle_window must be None or"
    with pytest.raises(ValueError, match=expected):
        DistributedBatchSamplerWrapper([[0]] * 4, 2, 0, shuffle=True, shuffle_window=window)
    assert len(DistributedBatchSamplerWrapper([[0]] * 4, 2, 0, shuffle=True, shuffle_window=2**30)) == 2


@pytest.mark.parametrize(
    "options,message",
    [
        ({"seed": 1.5}, "seed must be an integer in [-2**63, 2**63 - 1], got 1.5"),
        ({"seed": None}, "seed must be an integer in [-2**63, 2**63 - 1], got None"),
        ({"pad": "no"}, "pad must be True or False, got 'no'"),
        ({"shuffle": 1}, "shuffle must be True or False, got 1"),
        ({"even_shares": "no"}, "even_shares must be True or False, got 'no'"),
        ({"even_shares": None}, "even_shares must be True or False, got None"),
        ({"seed": 2**63}, "seed must be an integer in [-2**63, 2**63 - 1], got"),
        ({"seed": -(2**63) - 1}, "seed must be an integer in [-2**63, 2**63 - 1], got"),
    ],
)
def test_options_of_the_wrong_type_are_refused_at_construction(options: Dict[str, Any], message: str) -> None:
    """Refused where they are given, not at the first epoch with torch's words (seed), and never read as true
    because they are truthy (``pad="no"``)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        DistributedBatchSamplerWrapper([[0]] * 4, 2, 0, **options)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1])
@pytest.mark.parametrize("window", [None, 2])
def test_seeds_at_the_edges_of_the_range_shuffle_every_epoch(seed: int, window: Optional[int]) -> None:
    batches = [[i] for i in range(40)]
    wrapper = DistributedBatchSamplerWrapper(batches, 2, 0, shuffle=True, seed=seed, shuffle_window=window)
    orders = []
    for epoch in range(3):
        wrapper.set_epoch(epoch)
        orders.append(list(wrapper))
    assert all(len(order) == 20 for order in orders) and orders[0] != orders[1]


def test_numpy_integers_and_bools_are_accepted_as_options() -> None:
    wrapper = DistributedBatchSamplerWrapper(
        [[i] for i in range(8)], np.int64(2), 0, shuffle=np.bool_(True), shuffle_window=np.int64(2), seed=np.int32(3)
    )
    assert (wrapper.shuffle_window, wrapper.seed, wrapper.shuffle) == (2, 3, True)
    assert type(wrapper.shuffle_window) is int and type(wrapper.seed) is int and len(list(wrapper)) == 4


def test_a_resume_skips_in_the_first_iteration_that_reads_and_only_in_its_epoch() -> None:
    """resume_within_epoch(e, n) skips n items of the first iteration that reads anything, if it reads epoch e:
    a loop may make an iterator and finish that epoch without it (its checkpoint was at the epoch's end), then
    read it in the next epoch, which must be whole."""
    wrapper = DistributedBatchSamplerWrapper([[i] for i in range(12)], 2, 0, shuffle=True)
    whole = list(wrapper)
    wrapper.resume_within_epoch(0, 2)
    iter(wrapper)  # made, never read: the resume stays pending
    assert list(wrapper) == whole[2:]
    assert list(wrapper) == whole  # once only
    wrapper.resume_within_epoch(0, 2)
    made_in_epoch_0 = iter(wrapper)
    wrapper.set_epoch(1)
    next_epoch = list(made_in_epoch_0)
    assert len(next_epoch) == 6 and next_epoch != whole  # epoch 1's share, whole
    assert list(wrapper) == next_epoch  # the stale resume was dropped
    with pytest.raises(ValueError, match=r"done must be in \[0, 6\]"):
        wrapper.resume_within_epoch(1, 7)


def test_a_resume_count_given_as_a_callable_is_asked_for_when_its_epoch_is_read() -> None:
    """A callable count is called once, at the first read, and only when that read is of the resumed epoch; what
    it returns is checked like a count given at once. None drops a pending skip."""
    wrapper = DistributedBatchSamplerWrapper([[i] for i in range(12)], 2, 1, shuffle=True, shuffle_window=2)
    whole, asked = list(wrapper), []
    count = lambda: asked.append(1) or 4  # noqa: E731
    wrapper.resume_within_epoch(0, count)
    made = iter(wrapper)
    assert asked == []  # not when the iterator is made
    assert list(made) == whole[4:] and asked == [1]
    wrapper.resume_within_epoch(1, count)
    assert list(wrapper) == whole and asked == [1]  # epoch 0 read: not asked, and dropped
    wrapper.resume_within_epoch(0, lambda: 7)
    with pytest.raises(ValueError, match=r"done must be in \[0, 6\]"):
        next(iter(wrapper))
    wrapper.resume_within_epoch(0, 3)
    wrapper.resume_within_epoch(0, None)  # dropped
    assert list(wrapper) == whole


@pytest.mark.parametrize(
    "count", [2.0, True, "3", torch.tensor(True), np.True_], ids=["float", "bool", "string", "torch-bool", "numpy-bool"]
)
def test_a_resume_count_that_is_no_int_is_refused_where_it_is_given(count: Any) -> None:
    """A count that is no integer is refused by resume_within_epoch, or when its callable is asked; a float
    would only fail inside itertools when the epoch starts, and True would skip one item."""
    wrapper = DistributedBatchSamplerWrapper([[i] for i in range(12)], 2, 0)
    with pytest.raises(TypeError, match=r"done must be an int \(the number of items this rank yielded"):
        wrapper.resume_within_epoch(0, count)
    wrapper.resume_within_epoch(0, lambda: count)
    with pytest.raises(TypeError, match=r"done must be an int"):
        next(iter(wrapper))
    wrapper.resume_within_epoch(0, np.int64(2))  # a numpy integer is an int
    assert list(wrapper) == [[i] for i in range(4, 12, 2)]


def test_the_whole_epoch_permutation_is_torchs_drawn_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-epoch shuffle is torch.randperm seeded by seed + epoch (the same sequences as before it was
    drawn on one thread), and the thread count is restored after it, also when randperm fails."""
    threads = torch.get_num_threads()
    wrapper = DistributedBatchSamplerWrapper([[i] for i in range(100_000)], 2, 1, shuffle=True, seed=4)
    wrapper.set_epoch(3)
    expected = torch.randperm(100_000, generator=torch.Generator().manual_seed(7))[1::2].tolist()
    assert [batch[0] for batch in wrapper] == expected and torch.get_num_threads() == threads
    with pytest.raises(RuntimeError):
        _serial_randperm(-1, torch.Generator())
    assert torch.get_num_threads() == threads
    seen_threads = []
    real_randperm = torch.randperm

    def recording_randperm(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen_threads.append(torch.get_num_threads())
        return real_randperm(*args, **kwargs)

    monkeypatch.setattr(torch, "randperm", recording_randperm)
    torch.set_num_threads(2)  # as on a machine with cores to spare
    try:
        _serial_randperm(10, torch.Generator())
        assert seen_threads == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_empty_sampler() -> None:
    with pytest.raises(ValueError, match="empty"):
        DistributedBatchSamplerWrapper([], 2, 0)


@pytest.mark.parametrize("item", [5, "ab", [0.5, 1.0], None])
def test_items_that_are_not_index_sequences(item: Any) -> None:
    with pytest.raises(TypeError, match="sequence of integer indices"):
        list(DistributedBatchSamplerWrapper(Sized(4, 4, lambda i: item), 2, 0))


def test_tensor_and_numpy_batches_are_accepted() -> None:
    batches = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    assert [b.tolist() for b in DistributedBatchSamplerWrapper(batches, 2, 1)] == [[2, 3]]


@pytest.mark.parametrize(
    "world,rank,message",
    [
        (2, 2, "rank must be an integer in [0, 1], got 2"),
        (2, -1, "rank must be an integer in [0, 1], got -1"),
        (0, 0, "num_replicas must be an integer >= 1, got 0"),
        (2, 0.5, "rank must be an integer in [0, 1], got 0.5"),
    ],
)
def test_bad_world_or_rank(world: int, rank: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DistributedBatchSamplerWrapper([[0]], world, rank)


def test_pad_false_with_fewer_batches_than_ranks() -> None:
    with pytest.raises(ValueError, match="fewer than the 3 ranks"):
        DistributedBatchSamplerWrapper([[0], [1]], 3, 0, pad=False)


def test_no_process_group_and_no_world() -> None:
    with pytest.raises(RuntimeError, match="num_replicas and rank"):
        DistributedBatchSamplerWrapper([[0]])


def test_sampler_modules_import_without_lightning() -> None:
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_utilities'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lightning_ddp_ext.samplers, lightning_ddp_ext.dataloader, lightning_ddp_ext.consistency\n"
        "import lightning_ddp_ext.sync, lightning_ddp_ext._gradients, lightning_ddp_ext._exit\n"
        "import lightning_ddp_ext._loader_shares, lightning_ddp_ext._checks, lightning_ddp_ext._windows\n"
        "from lightning_ddp_ext import patch_dataloader_to_ddp, DistributedBatchSamplerWrapper\n"
        "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)\n"
        "exec('from lightning_ddp_ext import *')  # __all__ lists only what imports without Lightning\n"
        "assert 'DistributedSamplerWrapper' in dir() and 'CustomDDP' not in dir()\n"
        "try:\n"
        "    from lightning_ddp_ext import CustomDDP\n"
        "except ImportError as e:\n"
        "    assert 'pip install' in str(e)\n"
        "else:\n"
        "    raise AssertionError('CustomDDP imported without Lightning')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize(
    "options", [{}, {"shuffle": True}, {"shuffle": True, "shuffle_window": 4}, {"even_shares": False}]
)
def test_recorded_items_equal_what_was_yielded_on_long_epochs(options: dict) -> None:
    """Long enough to go through every stage of the streaming path (Python head, C middle, Python tail)."""
    source = VariableBatches(5000)
    wrapper = DistributedBatchSamplerWrapper(source, 3, 2, **options)
    wrapper.record_yielded = True
    yielded = list(wrapper)
    assert yielded == wrapper.yielded and len(yielded) == len(wrapper)
    if not options.get("shuffle"):
        assert [tuple(b) for b in yielded[: wrapper.real_share_length()]] == [tuple(b) for b in list(source)[2::3]]


def test_pad_is_part_of_the_dealing_options_only_where_it_changes_the_shares() -> None:
    """With even_shares=False pad is ignored (no padding at all), so ranks passing different pads deal the same
    shares and their digests agree; with even shares a different pad gives different shares, and digests."""

    def dealt(**options: Any) -> Any:
        wrapper = DistributedBatchSamplerWrapper([[i] for i in range(7)], num_replicas=2, rank=0, **options)
        return [list(batch) for batch in wrapper], wrapper.epoch_digest

    for shuffle in (False, True):
        assert (
            dealt(pad=True, even_shares=False, shuffle=shuffle) == dealt(pad=False, even_shares=False, shuffle=shuffle)
        )
        assert dealt(pad=True, shuffle=shuffle)[1] != dealt(pad=False, shuffle=shuffle)[1]


def test_the_epoch_a_wrapper_gave_a_sampler_is_remembered_while_the_sampler_lives() -> None:
    """A later wrapper around the same sampler learns that an earlier one moved it on (CustomDDP sets it back
    before the loader draws); nothing keeps the sampler alive, and one that takes no weak reference is unknown."""

    class NoWeakReference:
        __slots__ = ("epoch",)  # no __weakref__ slot

        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __len__(self) -> int:
            return 4

        def __iter__(self) -> Iterator[List[int]]:
            return iter([[0], [1], [2], [3]])

    class Epochs(NoWeakReference):
        __slots__ = ("__weakref__",)

    source = Epochs()
    assert _epoch_forwarded_to(source) is None
    DistributedBatchSamplerWrapper(source, num_replicas=2, rank=0).set_epoch(3)
    assert _epoch_forwarded_to(source) == 3 and source.epoch == 3
    DistributedBatchSamplerWrapper(source, num_replicas=2, rank=1).set_epoch(1)
    assert _epoch_forwarded_to(source) == 1
    watch = weakref.ref(source)
    del source
    gc.collect()  # the wrappers, gone too
    assert watch() is None  # the record held no reference
    assert not [key for key, (ref, _) in _EPOCHS_FORWARDED.items() if ref() is None]
    slotted = NoWeakReference()
    DistributedBatchSamplerWrapper(slotted, num_replicas=2, rank=0).set_epoch(2)
    assert slotted.epoch == 2 and _epoch_forwarded_to(slotted) is None

"""The optional C helper and its pure-Python twins: the compact store behind the whole-epoch shuffle, and the
dealing of the unshuffled path.

Ranks may run different builds (one with the helper compiled, one without), so both paths must store the
same indices, keep the same items, deal the same shares, count the same, and raise the same errors.
"""
from __future__ import annotations

import gc
import operator
import warnings
import weakref
from decimal import Decimal
from pathlib import Path
from itertools import chain
from typing import Any, Iterator, List, Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_ddp_ext import _store
from lightning_ddp_ext._store import KEEP, STORE, CompactStore
from lightning_ddp_ext.consistency import RunningDigest
from lightning_ddp_ext._windows import numpy_window_permutations
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper, DistributedSamplerWrapper


@pytest.fixture(params=["compiled", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "compiled" and _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built (no compiler at install time)")
    if request.param == "python":
        monkeypatch.setattr(_store, "_compact", None)
    return str(request.param)


def stored(store: CompactStore) -> List[Any]:
    return list(chain.from_iterable(store.blocks_in_order(np.arange(len(store)))))


NO_SAMPLES = np.zeros(0, dtype=np.int64)  # a WindowDealer's sample_windows when nothing is sampled


def test_the_helper_records_the_digest_of_the_sources_it_was_built_from() -> None:
    """setup.py passes the digest of _compact.c to the build: the helper in use must carry that of the file beside
    it (else _load_helper sets it aside and every test of the compiled path silently runs the Python one)."""
    helper = pytest.importorskip("lightning_ddp_ext._compact")
    assert helper.SOURCE_DIGEST == _store.source_digest(Path(_store.__file__).with_name("_compact.c"))
    assert _store._compact is helper


@pytest.mark.parametrize("recorded", ["0" * 64, None], ids=["other sources", "no digest (an older build)"])
def test_a_helper_built_from_other_sources_is_set_aside_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, recorded: Optional[str]
) -> None:
    helper = pytest.importorskip("lightning_ddp_ext._compact")
    if recorded is None:
        monkeypatch.delattr(helper, "SOURCE_DIGEST")
    else:
        monkeypatch.setattr(helper, "SOURCE_DIGEST", recorded)
    with pytest.warns(RuntimeWarning, match=r"was built from other sources than .*_compact\.c, so it is not used .*"
                      r"Rebuild it: `pip install -e \.`"):
        assert _store._load_helper() is None


def as_ints(item: Any) -> Any:
    return int(item) if isinstance(item, (int, np.integer)) else [int(i) for i in item]


index = st.integers(-(2**63), 2**63 - 1)
batch = st.lists(index, max_size=6).flatmap(
    lambda values: st.sampled_from(
        [
            values, tuple(values), np.array(values, dtype=np.int64), torch.tensor(values, dtype=torch.int64),
            [np.int64(0)] + values,  # a list that is not all exact ints: the converter's path
        ]
    )
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # the fixture only picks a path
)
@given(data=st.data(), batched=st.booleans(), blocks=st.integers(1, 3))
def test_read_stores_and_keeps_what_the_actions_say(path: str, data: st.DataObject, batched: bool, blocks: int) -> None:
    items = data.draw(st.lists(batch if batched else st.one_of(index, index.map(np.int64)), max_size=40))
    # expected (how many items will be stored) only sizes the C store's array: any guess must work
    store = CompactStore(batched=batched, owner="Sampler", expected=data.draw(st.integers(0, 60)))
    source = iter(items)
    expected_stored: List[Any] = []
    read = 0
    for _ in range(blocks):
        actions = bytes(data.draw(st.lists(st.integers(0, 3), max_size=25)))
        kept, count = store.read(source, actions)
        taken = items[read : read + len(actions)]
        assert count == len(taken)  # fewer than asked for only where the items ran out
        assert [as_ints(k) for k in kept] == [as_ints(i) for i, a in zip(taken, actions) if a & KEEP]
        assert all(k is i for k, i in zip(kept, (i for i, a in zip(taken, actions) if a & KEEP)))
        expected_stored += [as_ints(i) for i, a in zip(taken, actions) if a & STORE]
        read += count
    assert stored(store) == expected_stored
    assert len(store) == len(expected_stored)


# A Decimal and a numpy float have __int__ (which array.fromlist took, truncating, before Python 3.10) but no
# __index__: refused like a float.
@pytest.mark.parametrize("item", [[2**63], [0, 1.5], "ab", b"ab", [None], 7, [[0]], [Decimal("2.7")], [np.float32(2)]])
def test_items_that_are_not_index_sequences_are_named(path: str, item: Any) -> None:
    store = CompactStore(batched=True, owner="MySampler")
    with pytest.raises(TypeError, match=r"MySampler yielded .*; each item must be a sequence of integer indices"):
        store.read(iter([[0, 1], item]), bytes([STORE, STORE]))


@pytest.mark.parametrize("item", [2**63, 1.5, "3", None, [1], Decimal("2.7"), np.float32(2)])
def test_single_items_that_are_not_indices_are_named(path: str, item: Any) -> None:
    store = CompactStore(batched=False, owner="MySampler")
    with pytest.raises(TypeError, match=r"MySampler yielded .*; each item must be an integer index"):
        store.read(iter([0, item]), bytes([STORE, STORE]))


@pytest.mark.parametrize(
    "batched,item,why",
    [
        (True, [0, True], "A bool is not an index"),
        (True, (False,), "A bool is not an index"),
        (False, True, "A bool is not an index"),
        (True, iter([0, 1]), "It is an iterator, which would be used up by reading it"),
        (True, (i for i in [0, 1]), "It is an iterator, which would be used up by reading it"),
        (True, torch.tensor([True, False, True]), "A bool mask is not a batch of indices"),
        (True, np.array([True, False]), "A bool mask is not a batch of indices"),
        (True, [0, torch.tensor(True)], "A bool is not an index"),
        (True, [0, np.bool_(True)], "A bool is not an index"),
        (False, torch.tensor(True), "A bool is not an index"),
        (False, np.bool_(False), "A bool is not an index"),
    ],
    ids=[
        "bool-in-list", "bool-in-tuple", "single-bool", "list-iterator", "generator", "torch-bool-mask",
        "numpy-bool-mask", "torch-bool-in-list", "numpy-bool-in-list", "single-torch-bool", "single-numpy-bool",
    ],
)
def test_bools_and_iterators_are_refused_with_the_reason(path: str, batched: bool, item: Any, why: str) -> None:
    """A bool would be stored as 0 or 1 (``tensor[True]`` is not ``tensor[1]``), and reading an iterator would
    use it up: both are refused, on both paths, rather than changed."""
    store = CompactStore(batched=batched, owner="MySampler")
    with pytest.raises(TypeError, match=rf"MySampler yielded .*; each item must be .*\. {why}"):
        store.read(iter([[0] if batched else 0, item]), bytes([STORE, STORE]))


class IndexWithBrokenDtype:
    """An index (``__index__``) whose ``dtype`` attribute raises something other than AttributeError."""

    @property
    def dtype(self) -> Any:
        raise RuntimeError("no dtype here")

    def __index__(self) -> int:
        return 3


@pytest.mark.parametrize(
    "batch",
    [
        np.array([5, 2**40, 7], dtype=np.int64),
        np.array([5, 6], dtype=np.uint8),
        torch.tensor([5, 2**40, 7]),
        torch.tensor([5, 6], dtype=torch.uint8),
        [np.int64(5), np.int32(6)],
        [torch.tensor(5), 6],
        [IndexWithBrokenDtype(), 4],
        np.array([5, True], dtype=object),
    ],
    ids=["int64-array", "uint8-array", "tensor", "uint8-tensor", "numpy-ints", "0-d-tensor", "broken-dtype", "objects"],
)
def test_integer_arrays_tensors_and_index_objects_are_stored_as_their_values(path: str, batch: Any) -> None:
    """Arrays and tensors of integers are read by their tolist() (not a 0-d tensor per element), others one by one;
    an object with __index__ is an index whatever its other attributes do. An object array holding True is no
    batch of indices."""
    store = CompactStore(batched=True, owner="MySampler")
    if isinstance(batch, np.ndarray) and batch.dtype == object:
        with pytest.raises(TypeError, match="A bool is not an index"):
            store.read(iter([batch]), bytes([STORE]))
        return
    store.read(iter([batch, [1]]), bytes([STORE, STORE]))
    assert stored(store) == [[operator.index(value) for value in batch], [1]]
    assert _store.indices_of(batch, batched=True) == tuple(operator.index(value) for value in batch)


@pytest.mark.parametrize(
    "batch",
    [
        torch.tensor([0.5]),
        np.array([1.0, 2.0]),
        np.array([1, 2], dtype="timedelta64[ns]"),  # tolist() gives ints for these units
        np.array([1, 2], dtype="datetime64[ns]"),
        torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 1.0, 0, torch.quint8),
    ],
    ids=["float-tensor", "integral-floats", "timedelta-ns", "datetime-ns", "quantized"],
)
def test_arrays_and_tensors_of_other_than_integers_are_refused_as_before(path: str, batch: Any) -> None:
    """Only arrays and tensors of integers are read by tolist(), which turns some dates into plain ints."""
    store = CompactStore(batched=True, owner="MySampler")
    with pytest.raises(TypeError, match=r"(?s)MySampler yielded .*; each item must be a sequence of integer indices"):
        store.read(iter([batch]), bytes([STORE]))


def test_a_sparse_integer_tensor_batch_is_read_by_iterating_it(path: str) -> None:
    store = CompactStore(batched=True, owner="MySampler")
    store.read(iter([torch.tensor([1, 0, 2]).to_sparse()]), bytes([STORE]))
    assert stored(store) == [[1, 0, 2]]


@pytest.mark.parametrize("batched,item", [(True, [0, 2**63]), (True, [-(2**63) - 1]), (False, 2**64)])
def test_indices_past_64_bits_are_named_as_such(path: str, batched: bool, item: Any) -> None:
    store = CompactStore(batched=batched, owner="MySampler")
    with pytest.raises(TypeError, match=r"an index must fit in 64 bits \(-2\*\*63 <= index < 2\*\*63\)"):
        store.read(iter([item]), bytes([STORE]))


def test_rebuilt_batches_are_new_lists_in_the_asked_order(path: str) -> None:
    batches = [[i, i + 1, -i] for i in range(300)] + [[], [2**62]]
    store = CompactStore(batched=True, owner="Sampler")
    assert store.read(iter(batches), bytes([STORE]) * len(batches)) == ([], len(batches))
    order = np.random.default_rng(0).permutation(len(batches))
    rebuilt = list(chain.from_iterable(store.blocks_in_order(order)))
    assert rebuilt == [batches[i] for i in order]
    assert all(type(b) is list and b is not batches[i] for b, i in zip(rebuilt, order))


@pytest.mark.parametrize("batched", [True, False])
def test_indices_are_held_as_int32_until_one_needs_int64(path: str, batched: bool) -> None:
    """Narrow storage halves the store; an index past int32, in the middle of a block or in a later one,
    widens it without changing what was stored."""
    edges = [2**31 - 1, -(2**31), 0, 5]
    wide = [2**31, -(2**31) - 1, 2**63 - 1]
    store = CompactStore(batched=batched, owner="Sampler")
    items: List[Any] = [[value, value] for value in edges] if batched else edges
    store.read(iter(items), bytes([STORE]) * len(items))
    assert store.itemsize == 4
    for value in wide:
        later = [[1, value], [3]] if batched else [1, value, 3]
        store.read(iter(later), bytes([STORE]) * len(later))
        items += later
        assert store.itemsize == 8
    assert stored(store) == items


def test_errors_raised_by_the_sampler_propagate(path: str) -> None:
    def failing() -> Iterator[List[int]]:
        yield [0]
        raise RuntimeError("sampler broke")

    with pytest.raises(RuntimeError, match="sampler broke"):
        CompactStore(batched=True, owner="Sampler").read(failing(), bytes([STORE, STORE, STORE]))


@pytest.mark.parametrize("batched", [True, False])
def test_a_bad_item_read_before_the_sampler_fails_is_named_on_both_paths(path: str, batched: bool) -> None:
    """The C store stores each item as it reads it, so a bad one is refused before the sampler's later failure
    is reached; the pure-Python path reads a block first, and stores what it read before raising the failure."""

    def bad_then_failing() -> Iterator[Any]:
        yield [0] if batched else 0
        yield [1.5] if batched else 1.5
        yield [2] if batched else 2
        raise RuntimeError("sampler broke")

    with pytest.raises(TypeError, match=r"Sampler yielded \[?1\.5\]?; each item must be"):
        CompactStore(batched=batched, owner="Sampler").read(bad_then_failing(), bytes([STORE] * 8))
    store = CompactStore(batched=batched, owner="Sampler")  # a bad item the rank drops is not read into the store
    with pytest.raises(RuntimeError, match="sampler broke"):
        store.read(bad_then_failing(), bytes([STORE, 0, STORE, STORE]))


@pytest.mark.parametrize("shuffle_window", [None, 4])
@pytest.mark.parametrize("cls", [DistributedBatchSamplerWrapper, DistributedSamplerWrapper])
def test_shuffles_are_the_same_on_both_paths(
    monkeypatch: pytest.MonkeyPatch, cls: type, shuffle_window: Optional[int]
) -> None:
    """A rank with the helper and a rank without it must deal the same shares with the same digests."""
    if _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    variable_batches = [list(range(3 * i, 3 * i + 1 + i % 5)) for i in range(3000)]
    source: Any = variable_batches if cls is DistributedBatchSamplerWrapper else range(5, 3005)

    def deal() -> List[Any]:
        result = []
        for rank in range(3):
            wrapper = cls(source, num_replicas=3, rank=rank, shuffle=True, seed=11, shuffle_window=shuffle_window)
            wrapper.set_epoch(2)
            result.append((list(wrapper), wrapper.head_digest, wrapper.epoch_digest))
        return result

    compiled = deal()
    monkeypatch.setattr(_store, "_compact", None)
    assert deal() == compiled


def test_the_digest_hashes_the_same_keys_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest's key for a batch: the helper makes it for exact lists and tuples of exact ints; everything
    else, and every rank without the helper, takes the Python path. Both must give equal keys (so equal
    digests across builds) and the same error for an item that is not a batch of indices."""
    if _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    batches: List[Any] = [[3, 1, 2], (4, 5), [], (), [np.int64(7), 8], np.array([1, 2]), [2**70], range(3)]
    errors: List[Any] = ["ab", [1.5], [None, 1], (2, "3"), [True, 2], (False,), iter([1])]

    def keys_and_errors() -> List[Any]:
        digest = RunningDigest("Sampler", 0, len(batches), batched=True)
        outcome: List[Any] = [digest._key(batch, position) for position, batch in enumerate(batches)]
        for item in errors:
            with pytest.raises(TypeError) as raised:
                digest._key(item, 5)
            outcome.append(str(raised.value))
        digest.update(batches, 0)
        return [*outcome, digest.snapshot()]

    compiled = keys_and_errors()
    assert compiled[0] == (3, 1, 2) and compiled[3] == ()
    monkeypatch.setattr(_store, "_compact", None)
    assert keys_and_errors() == compiled


class Declared:
    """Yields ``items`` but claims ``declared`` of them (a wrong ``__len__`` when they differ); with ``fail``,
    raises instead of yielding the last item."""

    def __init__(self, items: List[Any], declared: int, fail: bool = False) -> None:
        self.items, self.declared, self.fail = items, declared, fail

    def __len__(self) -> int:
        return self.declared

    def __iter__(self) -> Iterator[Any]:
        if not self.fail:
            return iter(self.items)
        return chain(self.items[:-1], map(operator.truediv, [1], [0]))  # ZeroDivisionError: a RuntimeError's kin


@pytest.mark.parametrize("actual", [2000, 1200, 1201, 2600, -1201])  # right, short at a round's end and inside it,
@pytest.mark.parametrize("world", [2, 3])  # long, and failing (-) at item 1201
@pytest.mark.parametrize("shuffle_window", [0, 1, 16])  # 0: unshuffled
@pytest.mark.parametrize("record", [False, True])  # record_yielded, as evaluation loaders use it
def test_dealing_is_the_same_on_both_paths(
    monkeypatch: pytest.MonkeyPatch, actual: int, world: int, shuffle_window: int, record: bool
) -> None:
    """Shares, digests, and for a wrong __len__ or a failing sampler the error and the number of items each
    rank yielded before it, which must be the same on every rank (or DDP hangs)."""
    if _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    source = Declared([[i, i + 1] for i in range(abs(actual))], declared=2000, fail=actual < 0)
    options = {"shuffle": True, "seed": 5, "shuffle_window": shuffle_window} if shuffle_window else {}

    def deal() -> List[Any]:
        outcomes = []
        for rank in range(world):
            wrapper = DistributedBatchSamplerWrapper(source, num_replicas=world, rank=rank, **options)
            wrapper.record_yielded = record
            yielded: List[Any] = []
            try:
                yielded.extend(wrapper)
            except (RuntimeError, ZeroDivisionError) as error:
                outcomes.append((str(error), len(yielded)))
            else:
                outcomes.append((yielded, wrapper.epoch_digest))
            assert wrapper.yielded == (yielded if record else [])  # recording neither adds nor loses items
        return outcomes

    compiled = deal()
    if actual != 2000:
        assert len({count for _, count in compiled}) == 1, "ranks yielded different numbers of items before the error"
    monkeypatch.setattr(_store, "_compact", None)
    assert deal() == compiled


@pytest.mark.parametrize("shuffle_window", [1, 4])
def test_a_bad_digest_sample_stops_both_paths_after_the_same_items(
    monkeypatch: pytest.MonkeyPatch, shuffle_window: int
) -> None:
    """Past the head, the digest hashes one sampled item a block. C hashes it as it reads it and has yielded
    the block's earlier windows by then; the Python path reads the block first, and yields those windows
    before it raises too, so ranks on either path (a node built without a compiler) stay in step."""
    if _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")

    class TurnsBad:
        def __len__(self) -> int:
            return 20_000

        def __iter__(self) -> Iterator[Any]:
            return ([i] if i < 3_000 else "not a batch" for i in range(20_000))

    def deal() -> List[int]:
        counts = []
        for rank in range(2):
            yielded: List[Any] = []
            wrapper = DistributedBatchSamplerWrapper(TurnsBad(), 2, rank, shuffle=True, shuffle_window=shuffle_window)
            with pytest.raises(TypeError, match="TurnsBad yielded 'not a batch'"):
                yielded.extend(wrapper)
            counts.append(len(yielded))
        return counts

    compiled = deal()
    assert compiled[0] == compiled[1] > 1_000
    monkeypatch.setattr(_store, "_compact", None)
    assert deal() == compiled


def test_a_batch_whose_len_disagrees_with_its_iteration_is_stored_as_it_iterates(path: str) -> None:
    class LenSaysOne(list):
        def __len__(self) -> int:
            return 1

    class LenSaysThree(list):
        def __len__(self) -> int:
            return 3

    batches = [[0], LenSaysOne([1, 2, 3]), [4], LenSaysThree([5, 6]), LenSaysOne([7, 8])]  # the last two cancel out
    store = CompactStore(batched=True, owner="Sampler")
    store.read(iter(batches), bytes([STORE]) * 5)
    assert stored(store) == [[0], [1, 2, 3], [4], [5, 6], [7, 8]]


@pytest.mark.parametrize("actual", [7000, 5501, -5501])  # right, short and failing inside the third chunk
@pytest.mark.parametrize("world", [2, 3])
def test_unshuffled_chunks_are_the_same_on_both_paths(monkeypatch: pytest.MonkeyPatch, actual: int, world: int) -> None:
    """Past the head the unshuffled path deals in C in one go, sampling the last item of every 1,024 rounds
    for the digest, and in Python a chunk of 1,024 rounds at a time: over several chunks, both must yield and
    hash the same, and stop at the same item."""
    if _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    source = Declared([[i, 2 * i] for i in range(abs(actual))], declared=7000, fail=actual < 0)

    def deal() -> List[Any]:
        outcomes: List[Any] = []  # per rank: what it yielded, then its error or its digest
        for rank in range(world):
            wrapper = DistributedBatchSamplerWrapper(source, num_replicas=world, rank=rank)
            yielded: List[Any] = []
            try:
                yielded.extend(wrapper)
            except (RuntimeError, ZeroDivisionError) as error:
                outcomes.append((yielded, str(error)))
            else:
                outcomes.append((yielded, wrapper.epoch_digest))
        return outcomes

    compiled = deal()
    assert len({len(yielded) for yielded, _ in compiled}) == 1, "ranks yielded different numbers of items"
    monkeypatch.setattr(_store, "_compact", None)
    assert deal() == compiled


def test_the_window_dealer_deals_unshuffled_rounds() -> None:
    """Windows of one round, not permuted, each holding the rank's item: what the unshuffled path deals in C."""
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    samples: List[Any] = []
    dealer = compact.WindowDealer(iter(range(8)), None, 3, 3, 1, 0, 2, np.array([1]), samples.append)
    assert list(dealer) == [1, 4] and samples == [5] and dealer.read == 6  # the chunk's last item
    short = compact.WindowDealer(iter(range(5)), None, 3, 3, 1, 0, 2, np.array([1]), samples.append)
    assert list(short) == [1] and short.read == 5 and samples == [5]  # the unfinished round yields nothing
    assert list(compact.WindowDealer(iter("abcd"), None, 4, 2, 1, 0, 1, NO_SAMPLES, None)) == ["b", "d"]  # 2 rounds


def test_the_window_dealer_draws_the_same_permutations_as_numpy() -> None:
    """Ranks with and without the helper must permute every window alike: the dealer draws window by window
    what the numpy twin, ``numpy_window_permutations``, draws for many windows at once."""
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    for seed in (0, 12345, 2**64 - 1):
        for world, per_rank in ((1, 1), (2, 16), (3, 5), (8, 16)):
            window = world * per_rank
            permutations = numpy_window_permutations(seed, 5, 7, window, window)
            items = range(5 * window, 12 * window)
            shares = [
                list(compact.WindowDealer(iter(items), seed, window, world, rank, 5, 12, NO_SAMPLES, None))
                for rank in range(world)
            ]
            for rank, share in enumerate(shares):
                own = permutations[:, rank::world] + np.arange(5 * window, 12 * window, window)[:, None]
                assert share == own.reshape(-1).tolist()
            assert sorted(chain.from_iterable(shares)) == list(items)
    samples: List[Any] = []
    dealer = compact.WindowDealer(iter(range(70)), 7, 10, 2, 0, 0, 7, np.array([2, 5, 6]), samples.append)
    list(dealer)
    assert samples == [29, 59, 69] and dealer.read == 70  # the listed windows' last items
    modular = [
        list(compact.WindowDealer(iter(range(32)), seed, 32, 2, 0, 0, 1, NO_SAMPLES, None)) for seed in (-1, 2**64 - 1)
    ]
    assert modular[0] == modular[1]  # seeds count modulo 2**64, as in numpy


def test_c_window_permutations_match_numpy_and_check_their_arguments() -> None:
    """``_windows.window_permutations`` takes its rows from C when the helper is built: the same rows as the
    numpy twin, including the epoch's last window (fewer positions than the counters' stride)."""
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    for seed in (0, 2**63 - 2, 2**64 - 1, 2**64 + 5, -1):
        cases = ((0, 3, 32, 32), (10**9, 2, 20, 32), (7, 70, 5, 5), (0, 1, 1, 1), (4, 0, 8, 8))
        for first, count, size, stride in cases:
            out = np.empty((count, size), dtype=np.int64)
            assert compact.window_permutations(seed, first, count, size, stride, out) is None
            assert (out == numpy_window_permutations(seed, first, count, size, stride)).all()
    with pytest.raises(TypeError, match="contiguous buffer of int64"):
        compact.window_permutations(0, 0, 1, 4, 4, np.empty(4, dtype=np.int32))
    with pytest.raises(ValueError, match="out holds 3 items, not count \\* size = 4"):
        compact.window_permutations(0, 0, 1, 4, 4, np.empty(3, dtype=np.int64))
    with pytest.raises(ValueError, match="size <= stride"):
        compact.window_permutations(0, 0, 1, 4, 3, np.empty(4, dtype=np.int64))
    with pytest.raises(ValueError, match="first, count >= 0"):
        compact.window_permutations(0, 0, -1, 4, 4, np.empty(0, dtype=np.int64))
    with pytest.raises(TypeError):
        compact.window_permutations(1.5, 0, 1, 4, 4, np.empty(4, dtype=np.int64))
    with pytest.raises(BufferError, match="not writable"):
        compact.window_permutations(0, 0, 1, 4, 4, bytes(32))


def test_the_window_dealer_yields_only_complete_windows_and_checks_its_arguments() -> None:
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    permutations = numpy_window_permutations(3, 0, 3, 4, 4)
    own = (permutations[:, 0::2] + np.arange(0, 12, 4)[:, None]).reshape(-1).tolist()
    letters = "abcdefghijkl"
    samples: List[Any] = []
    dealer = compact.WindowDealer(iter(letters), 3, 4, 2, 0, 0, 3, np.arange(3), samples.append)
    assert list(dealer) == [letters[p] for p in own] and (dealer.read, samples) == (12, ["d", "h", "l"])
    items = iter(letters[:10])  # runs out inside the third window: its items are not yielded
    dealer = compact.WindowDealer(items, 3, 4, 2, 0, 0, 3, NO_SAMPLES, None)
    assert list(dealer) == [letters[p] for p in own[:4]] and dealer.read == 10 and list(items) == []
    assert list(dealer) == []

    def failing() -> Iterator[str]:
        yield from letters[:5]
        raise RuntimeError("sampler broke")

    def refuse_the_second(item: str) -> None:
        if item == "h":
            raise TypeError("not an index")

    for items, error, message in ((failing(), RuntimeError, "sampler broke"), (iter(letters), TypeError, "not an")):
        dealer = compact.WindowDealer(items, 3, 4, 2, 0, 0, 3, np.arange(3), refuse_the_second)
        assert [next(dealer), next(dealer)] == [letters[p] for p in own[:2]]
        with pytest.raises(error, match=message):  # the sampler's error, or the sample's: the window is dropped
            next(dealer)
        assert list(dealer) == []

    class Item:  # weakly referable, to see which items are still alive
        pass

    created: "weakref.WeakSet[Item]" = weakref.WeakSet()

    def remembered(item: Item) -> Item:
        created.add(item)
        return item

    def make(count: int) -> Iterator[Item]:  # keeps no reference to what it yielded
        for _ in range(count):
            yield remembered(Item())

    for count in (12, 10, 6):  # every window complete; the third, or the second, left unfinished
        dealer = compact.WindowDealer(make(count), 3, 4, 2, 0, 0, 3, np.arange(3), lambda item: None)
        yielded = list(dealer)
        assert set(created) == set(yielded)  # an unfinished window's items, and the samples, are dropped
        del yielded, dealer
        assert not created
        dealer = compact.WindowDealer(make(count), 3, 4, 2, 0, 0, 3, NO_SAMPLES, None)
        first = next(dealer)
        del dealer  # with items held but not yielded yet
        assert set(created) == {first}
        del first
    with pytest.raises(ValueError, match="window a multiple of world, got window 5, world 2"):
        compact.WindowDealer(iter("ab"), 3, 5, 2, 0, 0, 1, NO_SAMPLES, None)
    with pytest.raises(ValueError, match="got window 0"):
        compact.WindowDealer(iter("ab"), 3, 0, 1, 0, 0, 1, NO_SAMPLES, None)
    with pytest.raises(ValueError, match="0 <= rank < world and 0 <= first <= end, got rank 2"):
        compact.WindowDealer(iter("ab"), 3, 4, 2, 2, 0, 1, NO_SAMPLES, None)
    with pytest.raises(TypeError, match="sample_windows must be a contiguous buffer of int64"):
        compact.WindowDealer(iter("ab"), 3, 4, 2, 0, 0, 1, np.arange(3, dtype=np.int32), None)
    with pytest.raises(ValueError, match="got rank 0, first 2, end 1"):
        compact.WindowDealer(iter("ab"), 3, 4, 2, 0, 2, 1, NO_SAMPLES, None)
    with pytest.raises(TypeError, match="seed must be an int or None, got str"):
        compact.WindowDealer(iter("ab"), "3", 4, 2, 0, 0, 1, NO_SAMPLES, None)
    with pytest.raises(TypeError, match="on_sample must be callable or None, got int"):
        compact.WindowDealer(iter("ab"), 3, 4, 2, 0, 0, 1, NO_SAMPLES, 5)
    with pytest.raises(TypeError, match="items must be an iterator"):
        compact.WindowDealer("abcd", 3, 4, 2, 0, 0, 1, NO_SAMPLES, None)


def test_the_c_store_checks_its_arguments() -> None:
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")

    def refuse(item: Any) -> bytes:
        raise ValueError("sampler broke")

    store = compact.Store(True, refuse)
    assert store.read(iter([[1, 2], (3,)]), bytes([STORE, STORE])) == ([], 2)
    assert store.lists(np.array([1, 0])) == [[3], [1, 2]]
    with pytest.raises(IndexError, match="slot 2 is out of range: the store holds 2 items"):
        store.lists(np.array([2]))
    with pytest.raises(IndexError, match="slot -1"):
        store.lists(np.array([-1]))
    with pytest.raises(TypeError, match="slots must be a contiguous buffer of int64"):
        store.lists(np.array([0], dtype=np.int32))
    with pytest.raises(TypeError, match="items must be an iterator"):
        store.read([[0]], bytes([STORE]))
    with pytest.raises(ValueError, match="sampler broke"):  # what convert raises (the users' error) propagates
        store.read(iter([[1.5]]), bytes([STORE]))
    with pytest.raises(TypeError, match="convert must return the item's indices as int64 bytes"):
        compact.Store(False, lambda item: b"abc").read(iter([1.5]), bytes([STORE]))
    for wrong in (bytes(16), b""):  # a single index is exactly one value: more or none would misalign the rest
        with pytest.raises(TypeError, match=r"8 bytes for an unbatched store"):
            compact.Store(False, lambda item, wrong=wrong: wrong).read(iter([1.5]), bytes([STORE]))
    with pytest.raises(TypeError, match="convert must be callable"):
        compact.Store(True, None)
    assert len(store) == 2  # failed reads stored nothing


@pytest.mark.parametrize("expected", [0, 1, 50, 10_000])
def test_the_c_store_holds_any_number_of_items_whatever_it_expected(expected: int) -> None:
    """expected only sizes the array: fewer or more items, and items longer than the first ones, still fit."""
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    batches = [list(range(i, i + 1 + i % 7)) for i in range(300)] + [list(range(5000))]
    store = compact.Store(True, bytes, expected)
    for start in range(0, len(batches), 64):
        block = batches[start : start + 64]
        store.read(iter(block), bytes([STORE]) * len(block))
    assert store.lists(np.arange(len(batches))) == batches
    singles = compact.Store(False, bytes, expected)
    singles.read(iter(range(-5, 1000)), bytes([STORE]) * 1005)
    assert singles.lists(np.array([1004, 0])) == [999, -5]


@pytest.mark.parametrize("expected", [2**61, 2**63 - 1, 10**12])
def test_the_c_store_takes_expected_as_a_hint_even_when_absurd(expected: int) -> None:
    """expected sizes the arrays only up to a bounded multiple of what is stored: a huge value neither overflows
    the size of the batch ends (it corrupted the heap) nor reserves memory the machine refuses."""
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    store = compact.Store(True, bytes, expected)
    batches = [[i, i + 1] for i in range(100)]
    store.read(iter(batches), bytes([STORE]) * 100)
    assert store.lists(np.arange(100)) == batches


def test_longest_batches_first_do_not_make_the_c_store_reserve_for_the_epoch_at_their_size() -> None:
    """A token-budget sampler sorted by length yields its longest batches first; the C store's projection from
    them (here 50,000 indices a batch for 200,020 batches: 40 GB) is capped, so the epoch (1.2 million indices)
    is stored in a bounded multiple of its size (it raised MemoryError, or took gigabytes of address space)."""
    import tracemalloc

    if _store._compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    long_first = [list(range(50_000)) for _ in range(20)] + [[i] for i in range(200_000)]
    tracemalloc.start()
    try:
        wrapper = DistributedBatchSamplerWrapper(long_first, 2, 0, shuffle=True)
        first = next(iter(wrapper))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert first in long_first
    assert peak < 150e6, f"storing ~0.6 million indices (2.4 MB) peaked at {peak / 1e6:.0f} MB"


def test_the_window_dealer_refuses_next_from_inside_its_own_read() -> None:
    """A source or on_sample that calls next() on the dealer while it reads a window would clear what the read
    holds (an out-of-bounds read after it): it is refused."""
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")
    dealer: Any = None

    def reenter(item: Any) -> None:
        next(dealer)

    dealer = compact.WindowDealer(iter(range(12)), 3, 4, 2, 0, 0, 3, np.arange(3), reenter)
    with pytest.raises(RuntimeError, match="WindowDealer is reading a window"):
        next(dealer)
    assert list(dealer) == []  # exhausted after the error, as after any other


def test_a_reference_cycle_through_the_window_dealer_is_collected() -> None:
    """A dealer holding tuples that refer back to it: tuples cannot break a cycle, so the dealer must
    (tp_clear), or the garbage collector leaves every such cycle alive."""
    compact = _store._compact
    if compact is None:
        pytest.skip("the C helper lightning_ddp_ext._compact is not built")

    def alive() -> int:
        return sum(type(o) is compact.WindowDealer for o in gc.get_objects())

    def make_cycle() -> None:
        box: List[Any] = []
        dealer = compact.WindowDealer(((box[0],) for _ in range(40)), None, 4, 2, 0, 0, 10, NO_SAMPLES, None)
        box.append(dealer)
        next(dealer)  # it holds a (dealer,) tuple now

    gc.collect()
    before = alive()
    for _ in range(50):
        make_cycle()
    gc.collect()
    assert alive() == before


class RefillsOneList:
    """A batch sampler that refills one list in place after each yield: every batch the wrappers hold (a round,
    a window, the head) would read as its latest contents."""

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for i in range(8):
            batch[:] = [2 * i, 2 * i + 1]
            yield batch


@pytest.mark.parametrize("options", [{}, {"shuffle": True, "shuffle_window": 2}, {"shuffle": True}])
def test_a_batch_sampler_that_refills_one_list_is_warned_about_on_both_paths(path: str, options: Any) -> None:
    wrapper = DistributedBatchSamplerWrapper(RefillsOneList(), num_replicas=2, rank=0, **options)
    expected = r"RefillsOneList yielded the very same list object as batches 0 and 1 of epoch 0.* yield a new list"
    with pytest.warns(UserWarning, match=expected):
        list(wrapper)


def test_batches_repeated_unchanged_are_dealt_as_they_are_and_only_a_shared_list_is_warned_about(path: str) -> None:
    shared = [0, 1]
    with pytest.warns(UserWarning, match="yield a copy of it to silence this warning"):
        assert [list(b) for b in DistributedBatchSamplerWrapper([shared] * 8, 2, 0)] == [[0, 1]] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tuple cannot be refilled; new lists are new objects
        for source in ([(0, 1)] * 8, [[0, 1] for _ in range(8)]):
            for options in ({}, {"shuffle": True, "shuffle_window": 2}, {"shuffle": True}):
                assert [list(b) for b in DistributedBatchSamplerWrapper(source, 2, 0, **options)] == [[0, 1]] * 4
    with warnings.catch_warnings():  # an index sampler repeats small ints, which are shared objects
        warnings.simplefilter("error")
        assert list(DistributedSamplerWrapper([3] * 8, 2, 0)) == [3] * 4


@pytest.mark.parametrize("options", [{}, {"shuffle": True, "shuffle_window": 4}, {"shuffle": True}])
@pytest.mark.parametrize("length", [100, 3000])
def test_the_epoch_digest_covers_the_last_round_on_both_paths(path: str, options: Any, length: int) -> None:
    """Samplers that agree on all but one batch of the last round deal different shares (one batch lost, one
    repeated): the epoch digest, which the next epoch's check compares, must tell them apart in every mode. The
    shuffled modes hashed only the last position, so a difference in the round's other batches passed."""

    def epoch_digest(batches: List[List[int]], world: int = 2) -> Any:
        wrapper = DistributedBatchSamplerWrapper(batches, num_replicas=world, rank=0, **options)
        list(wrapper)
        return wrapper.epoch_digest

    agreed = [[i] for i in range(length)]
    assert epoch_digest(agreed) == epoch_digest([list(batch) for batch in agreed])
    assert epoch_digest(agreed) != epoch_digest(agreed[:-1] + [[length - 2]])
    assert epoch_digest(agreed) != epoch_digest(agreed[:-2] + [[length - 3], agreed[-1]])
    for world in (7, 8):  # the first batch of a last round of several: it counts too
        first = (-(-length // world) * world - 1) // world * world
        assert first < length - 1
        changed = agreed[:first] + [[length]] + agreed[first + 1 :]
        assert epoch_digest(agreed, world) != epoch_digest(changed, world)

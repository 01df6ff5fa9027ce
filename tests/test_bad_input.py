"""The bad-input catalogue (docs/bad_input.md): each case ends in a clear error or a documented behaviour.

Cases the sampler layer decides are checked in this process for every rank at once (explicit
``num_replicas``/``rank``, no processes). Cases only a real run can show (lengths that differ per rank, loaders
Lightning hands over as they are) run a Trainer on 2 CPU ranks started once for the module (the calls of
``RANK_CALLS``, see ``distributed_helpers.call_on_ranks``); pickling for spawn runs Lightning's spawn launcher.
Each run has a small process-group timeout and a bounded wait, and no process may outlive its test.
"""
from __future__ import annotations

import functools
import re
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import lightning.pytorch as pl
import pytest
import torch
from distributed_helpers import CallOutcomes, RankCalls
from torch.utils.data import DataLoader, IterableDataset, WeightedRandomSampler

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from reliability_common import IndexDataset, WeightRecorder, strategy, trainer_kwargs  # noqa: E402
from scenarios import assert_raised, records, records_and_error  # noqa: E402

from lightning_ddp_ext import (  # noqa: E402
    DistributedBatchSamplerWrapper,
    DistributedSamplerWrapper,
    patch_dataloader_to_ddp,
)
from lightning_ddp_ext.samplers import LengthMismatchError  # noqa: E402

WORLD = 2
RUN_TIMEOUT_S = 240  # per Trainer test: startup of 2 ranks on a busy 2-core machine plus the 20 s PG timeout

#: The runs made on the module's two ranks (see the module's docstring), filled in beside the tests that check them.
RANK_CALLS: RankCalls = {}


# ------------------------------------------------------------------------------------------------ samplers
class NoLength:
    """A batch sampler without __len__."""

    def __iter__(self) -> Iterator[List[int]]:
        return iter([[0, 1], [2, 3]])


class Batches:
    """Yields ``items`` each epoch; ``len()`` returns ``length`` (which may lie)."""

    def __init__(self, items: List[Any], length: int | None = None) -> None:
        self.items, self.length = items, len(items) if length is None else length

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return self.length


class OneShot:
    """A sized iterator that is its own iterator: exhausted after the first epoch."""

    def __init__(self, n: int) -> None:
        self.n, self._it = n, iter([[i] for i in range(n)])

    def __iter__(self) -> Iterator[List[int]]:
        return self._it

    def __len__(self) -> int:
        return self.n


def shares(make: Any, world: int = WORLD) -> List[Any]:
    """Every rank's outcome for one epoch: its list of items, or (items yielded before the error, the error)."""
    outcomes: List[Any] = []
    for rank in range(world):
        got: List[Any] = []
        try:
            for item in make(rank):
                got.append(item)
        except Exception as error:  # noqa: BLE001 - the outcome is what we check
            outcomes.append((got, error))
        else:
            outcomes.append(got)
    return outcomes


# --------------------------------------------------------------------- the sampler-layer cases, no processes
@pytest.mark.parametrize("source", [NoLength(), ([i] for i in range(4))], ids=["class-without-len", "generator"])
def test_batch_sampler_without_len_is_refused_at_construction(source: Any) -> None:
    loader = DataLoader(range(4), batch_sampler=source)
    with pytest.raises(TypeError, match=r"needs an iterable with __len__, got (NoLength|generator).*Add a __len__"):
        patch_dataloader_to_ddp(loader, num_replicas=WORLD, rank=0)


class IndexedBatches:
    """Batches through the sequence protocol (``__getitem__`` until IndexError, and ``__len__``): iter() and a
    DataLoader take it, with no ``__iter__``."""

    def __getitem__(self, position: int) -> List[int]:
        if position >= 5:
            raise IndexError(position)
        return [2 * position, 2 * position + 1]

    def __len__(self) -> int:
        return 5


@pytest.mark.parametrize("options", [{}, {"shuffle": True, "shuffle_window": 1}, {"shuffle": True}])
def test_a_batch_sampler_iterated_through_getitem_is_dealt(options: dict) -> None:
    loaders = [
        patch_dataloader_to_ddp(DataLoader(range(10), batch_sampler=IndexedBatches()), WORLD, rank, **options)
        for rank in range(WORLD)
    ]
    batches = [batch.tolist() for loader in loaders for batch in loader]
    assert [len(loader) for loader in loaders] == [3, 3]
    assert len(batches) == 6 and set(map(tuple, batches)) == {(2 * i, 2 * i + 1) for i in range(5)}  # one repeat


def test_a_sized_object_that_cannot_be_iterated_is_refused_at_construction() -> None:
    class LengthOnly:
        def __len__(self) -> int:
            return 3

    message = "got LengthOnly, which has __len__ but cannot be iterated. Give it an __iter__"
    with pytest.raises(TypeError, match=message):
        DistributedBatchSamplerWrapper(LengthOnly(), num_replicas=WORLD, rank=0)


@pytest.mark.parametrize("raised", [NotImplementedError(), TypeError("not sized")])
def test_a_len_that_raises_is_explained(raised: Exception) -> None:
    class UnsizedBatches(Batches):
        def __len__(self) -> int:
            raise raised

    said = re.escape(type(raised).__name__ + (f" ({raised})" if str(raised) else ""))
    with pytest.raises(TypeError, match=rf"len\(\) of UnsizedBatches raised {said}\. Every rank must know"):
        DistributedBatchSamplerWrapper(UnsizedBatches([[0], [1]]), num_replicas=WORLD, rank=0)


class NoLengthData(torch.utils.data.Dataset):
    """A map-style dataset that forgot ``__len__``: a default SequentialSampler takes it, until iterated."""

    def __getitem__(self, index: int) -> int:
        return index


class UnsizedData(NoLengthData):
    def __len__(self) -> int:
        raise NotImplementedError


@pytest.mark.parametrize(
    "dataset, raised",
    [
        (NoLengthData(), "TypeError (object of type 'NoLengthData' has no len())"),
        (UnsizedData(), "NotImplementedError"),
    ],
)
def test_a_dataset_without_len_under_a_default_sampler_is_explained(dataset: Any, raised: str) -> None:
    """Python's bare "object of type ... has no len()" (or an empty NotImplementedError) escaped, naming nothing."""
    name = type(dataset).__name__
    said = f"patch_dataloader_to_ddp: len() of the loader's dataset ({name}) raised {raised}. Its default sampler's"
    with pytest.raises(TypeError, match=re.escape(said) + f".* give {name} a __len__"):
        patch_dataloader_to_ddp(DataLoader(dataset, batch_size=2), num_replicas=WORLD, rank=0)


def test_one_shot_generator_as_index_sampler_is_refused_at_construction() -> None:
    loader = DataLoader(range(6), batch_size=2, sampler=(i for i in range(6)))
    with pytest.raises(TypeError, match="DistributedSamplerWrapper needs an iterable with __len__, got generator"):
        patch_dataloader_to_ddp(loader, num_replicas=WORLD, rank=0)


def test_sized_one_shot_iterator_fails_in_its_second_epoch_on_every_rank() -> None:
    for rank in range(WORLD):
        wrapper = DistributedBatchSamplerWrapper(OneShot(6), num_replicas=WORLD, rank=rank)
        assert list(wrapper) == [[rank], [rank + 2], [rank + 4]]
        wrapper.set_epoch(1)
        message = r"OneShot.__len__\(\) returned 6 but iterating it produced 0 item\(s\) in epoch 1"
        with pytest.raises(LengthMismatchError, match=message):
            list(wrapper)


@pytest.mark.parametrize("declared,actual", [(9, 6), (4, 6)], ids=["overstated", "understated"])
@pytest.mark.parametrize(
    "options", [{}, {"shuffle": True, "shuffle_window": 2}, {"shuffle": True}], ids=["in-order", "window", "full"]
)
@pytest.mark.parametrize("world", [2, 3])
def test_wrong_len_raises_with_both_numbers_after_equal_counts_on_every_rank(
    declared: int, actual: int, options: dict, world: int
) -> None:
    items = [[i] for i in range(actual)]
    outcomes = shares(
        lambda rank: DistributedBatchSamplerWrapper(Batches(items, declared), num_replicas=world, rank=rank, **options),
        world=world,
    )
    counts = set()
    for outcome in outcomes:
        assert isinstance(outcome, tuple), f"a rank finished without an error: {outcome}"
        yielded, error = outcome
        counts.add(len(yielded))
        assert isinstance(error, LengthMismatchError)
        assert f"__len__() returned {declared} but iterating it produced {actual}" in str(error)
    assert len(counts) == 1, f"ranks yielded different numbers of batches before failing: {counts}"


@pytest.mark.parametrize("wrapper", [DistributedBatchSamplerWrapper, DistributedSamplerWrapper])
def test_empty_sampler_is_refused_at_construction(wrapper: type) -> None:
    with pytest.raises(ValueError, match=r"Batches is empty \(len\(\) == 0\)"):
        wrapper(Batches([]), num_replicas=WORLD, rank=0)


# floats, a string, a bare index, None, nested lists, a bool (True is no index 1 to a tensor), an iterator (reading
# it to check it would leave the DataLoader an empty batch)
BAD_BATCHES = [[0.5, 1], "ab", 3, None, [[0, 1]], [True, 1], iter([0, 1])]
BAD_INDICES = [[1, 2], 1.0, "3", None, True]
MODES = [{}, {"shuffle": True, "shuffle_window": 1}, {"shuffle": True}]
MODE_IDS = ["in-order", "window", "full"]


def _bad_item_cases() -> List[Any]:
    cases = []
    for wrapper, items in ((DistributedBatchSamplerWrapper, BAD_BATCHES), (DistributedSamplerWrapper, BAD_INDICES)):
        for item in items:
            for options, mode in zip(MODES, MODE_IDS):
                case_id = f"{wrapper.__name__}-{item!r}-{mode}"
                cases.append(pytest.param(wrapper, item, options, id=case_id))
    return cases


@pytest.mark.parametrize("wrapper,item,options", _bad_item_cases())
def test_items_that_are_not_indices_raise_naming_the_sampler_and_the_item(
    wrapper: type, item: Any, options: dict
) -> None:
    """A bad item among the first 64 of the epoch is refused on every rank, after the same number of items."""
    good = [0, 1] if wrapper is DistributedBatchSamplerWrapper else 0
    expected = "a sequence of integer indices" if wrapper is DistributedBatchSamplerWrapper else "an integer index"
    for position in (0, 5, 63):
        source = Batches([good] * position + [item] + [good] * 5)
        counts = set()
        for rank in range(WORLD):
            produced: List[Any] = []
            message = rf"Batches yielded {re.escape(repr(item))}.*each item must be {expected}"
            with pytest.raises(TypeError, match=message):
                produced.extend(wrapper(source, num_replicas=WORLD, rank=rank, **options))
            counts.add(len(produced))
        assert len(counts) == 1, f"ranks yielded different numbers of items before the error: {counts}"


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_items_past_the_first_64_are_checked_on_a_sample_and_never_altered(options: dict) -> None:
    """Documented limit: past the first 64 items only a sample is validated (full shuffle: every item this rank
    keeps). An unchecked bad item reaches the dataset unchanged, exactly as on one process; it is never altered.
    Every rank's outcome is checked: the same error or the same count, and the item unchanged where it goes."""
    for position in range(64, 200, 7):
        batches: List[Any] = [[i] for i in range(200)]
        batches[position] = [0.5]
        outcomes = shares(lambda r: DistributedBatchSamplerWrapper(Batches(batches), WORLD, r, **options))
        failed = [outcome for outcome in outcomes if isinstance(outcome, tuple)]
        for _, error in failed:
            assert isinstance(error, TypeError) and "Batches yielded [0.5]" in str(error), error
        if "shuffle_window" in options or not options:  # streaming: a sampled position fails on every rank alike
            assert len(failed) in (0, WORLD), f"position {position}: only some ranks raised: {outcomes}"
        if not failed:
            assert [len(outcome) for outcome in outcomes] == [100] * WORLD, position
            assert sum(outcome.count([0.5]) for outcome in outcomes) == 1, f"position {position}: altered or lost"


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_full_shuffle_never_truncates_float_indices(options: dict) -> None:
    """Full shuffle stores this rank's share as integers: a tuple of floats past the sampled positions is refused
    by the rank that keeps it (int() would truncate 70.9 to 70, silently); in-order and windowed modes pass it on
    unchanged, exactly as one process would."""
    batches: List[Any] = [[i] for i in range(200)]
    batches[70] = (70.9,)
    outcomes = shares(lambda r: DistributedBatchSamplerWrapper(Batches(batches), WORLD, r, **options))
    if options.get("shuffle") and "shuffle_window" not in options:
        failed = [outcome for outcome in outcomes if isinstance(outcome, tuple)]
        assert len(failed) == 1, outcomes
        assert isinstance(failed[0][1], TypeError) and "Batches yielded (70.9,)" in str(failed[0][1])
        [kept] = [outcome for outcome in outcomes if not isinstance(outcome, tuple)]
        assert len(kept) == 100 and [70] not in kept, "70.9 was truncated"
    else:
        assert all(isinstance(outcome, list) for outcome in outcomes), outcomes
        assert sum(outcome.count((70.9,)) for outcome in outcomes) == 1, "70.9 was altered or lost"


@pytest.mark.parametrize(
    "num_replicas,rank,message",
    [
        (2, 2, r"rank must be an integer in \[0, 1\], got 2"),
        (2, -1, r"rank must be an integer in \[0, 1\], got -1"),
        (0, 0, r"num_replicas must be an integer >= 1, got 0"),
        (2, True, r"rank must be an integer in \[0, 1\], got True"),
        (2.0, 0, r"num_replicas must be an integer >= 1, got 2.0"),
    ],
)
def test_rank_and_world_size_out_of_range(num_replicas: Any, rank: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DistributedBatchSamplerWrapper(Batches([[0]]), num_replicas=num_replicas, rank=rank)
    with pytest.raises(ValueError, match=message):
        patch_dataloader_to_ddp(DataLoader(range(4), batch_size=2), num_replicas=num_replicas, rank=rank)


def test_no_process_group_and_no_world_is_a_clear_error_for_wrappers() -> None:
    with pytest.raises(RuntimeError, match="needs num_replicas and rank: pass them explicitly, or initialise"):
        DistributedBatchSamplerWrapper(Batches([[0]]))


@pytest.mark.parametrize("wrapper", [DistributedBatchSamplerWrapper, DistributedSamplerWrapper])
def test_pad_false_with_fewer_items_than_ranks_is_refused(wrapper: type) -> None:
    item = [0] if wrapper is DistributedBatchSamplerWrapper else 0
    with pytest.raises(ValueError, match=r"yields 1 item\(s\) per epoch, fewer than the 2 ranks, and pad=False"):
        wrapper(Batches([item]), num_replicas=2, rank=0, pad=False)
    assert [list(wrapper(Batches([item]), num_replicas=2, rank=r)) for r in range(2)] == [[item], [item]]  # pad=True


def test_pad_false_with_more_ranks_than_samples_is_refused_for_default_samplers_too() -> None:
    """torch's DistributedSampler(drop_last=True) would give every rank 0 samples: Lightning warns, trains nothing."""
    loader = DataLoader(range(1), batch_size=1)
    with pytest.raises(ValueError, match="fewer than the 2 ranks"):
        patch_dataloader_to_ddp(loader, num_replicas=2, rank=0, pad=False)


class _StreamThatShardsItself(IterableDataset):
    """An iterable dataset (it does not actually shard itself: a loader CustomDDP must hand over unchanged)."""

    def __iter__(self) -> Iterator[Any]:
        return ((torch.tensor([float(i)]), i) for i in range(6))


def test_iterable_dataset_loader_is_returned_unchanged_with_a_warning() -> None:
    loader = DataLoader(_StreamThatShardsItself(), batch_size=2)
    message = "_StreamThatShardsItself is an IterableDataset; the loader is returned unchanged"
    with pytest.warns(UserWarning, match=message) as record:
        assert patch_dataloader_to_ddp(loader, num_replicas=WORLD, rank=0) is loader
    assert [warning.filename for warning in record] == [__file__]  # it points at the call, not into the package


def test_loader_without_a_dataset_is_refused_by_name() -> None:
    for loader in (DataLoader(None, batch_sampler=[[0, 1]]), DataLoader(None, batch_size=2)):
        with pytest.raises(TypeError, match=r"dataset=None"):
            patch_dataloader_to_ddp(loader, num_replicas=WORLD, rank=0)


# ------------------------------------------------------------------------------------ real Trainer runs
class Unpicklable:
    """A batch sampler holding a lock: spawn cannot pickle it for the ranks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __iter__(self) -> Iterator[List[int]]:
        return iter([[0, 1], [2, 3]])

    def __len__(self) -> int:
        return 2


class LengthByRank:
    """len() and iteration depend on the rank: 6 batches on rank 0, 7 on rank 1 (e.g. data read per rank)."""

    def _count(self) -> int:
        return 6 + torch.distributed.get_rank()

    def __iter__(self) -> Iterator[List[int]]:
        return iter([[i] for i in range(self._count())])

    def __len__(self) -> int:
        return self._count()


class DataByRank(WeightRecorder):
    """A LightningModule whose train_dataloader() sizes its dataset by rank (default sampler: 6 vs 7 batches)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(24 + 4 * self.global_rank), batch_size=2)


def spawn_trainer(**options: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy("spawn", **options), **trainer_kwargs(max_epochs=1))


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_unpicklable_sampler_under_spawn_fails_before_any_rank_starts_naming_the_object(
    tmp_path: Path, spawn_job: None
) -> None:
    loader = DataLoader(IndexDataset(4), batch_sampler=Unpicklable())
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object") as raised:
        spawn_trainer().fit(WeightRecorder(str(tmp_path)), loader)
    message = str(raised.value)
    assert "train_dataloaders (DataLoader) -> .batch_sampler (Unpicklable) -> .lock (lock)" in message, message
    assert "strategy='ddp_custom_sampler'" in message, message


class SlottedHolder:
    __slots__ = ("guard",)

    def __init__(self) -> None:
        self.guard = threading.Lock()


class LeavesItsLockOut:
    """Pickles without its lock (``__getstate__``), but holds a lambda, which is what pickling fails on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.key = lambda index: index

    def __getstate__(self) -> Dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if name != "lock"}


class ReducesToItsArguments:
    def __init__(self, key: Any) -> None:
        self.key = key

    def __reduce__(self) -> Any:
        return ReducesToItsArguments, (self.key,)


def test_the_unpicklable_part_is_what_a_class_that_decides_its_pickling_pickles() -> None:
    """A class with its own __getstate__ or __reduce__ is walked through what it hands pickle, not through its
    attributes: the lock it leaves out is not named, the lambda it keeps is."""
    from lightning_ddp_ext._pickling import unpicklable_path

    assert unpicklable_path({"s": LeavesItsLockOut()}, "x") == "x (dict) -> ['s'] (LeavesItsLockOut) -> .key (function)"
    assert unpicklable_path(ReducesToItsArguments(threading.Lock()), "x") == (
        "x (ReducesToItsArguments) -> (reduced) args[0] (lock)"
    )


def test_the_unpicklable_part_is_found_in_slots_dict_keys_and_partials() -> None:
    from lightning_ddp_ext._pickling import unpicklable_path

    assert unpicklable_path({"ok": 1}, "x") is None
    assert unpicklable_path({"s": SlottedHolder()}, "x") == "x (dict) -> ['s'] (SlottedHolder) -> .guard (lock)"
    assert unpicklable_path({threading.Lock(): 1}, "x").startswith("x (dict) -> key <unlocked _thread.lock")
    assert unpicklable_path(functools.partial(print, sep=threading.Lock()), "x") == (
        "x (partial) -> .keywords['sep'] (lock)"
    )


def _fit_on_lengths_by_rank(model_class: type) -> Dict[str, Any]:
    """Fit ``model_class`` (on a LengthByRank loader unless the model brings its own): the error and the records."""
    model, trainer = model_class(), pl.Trainer(strategy=strategy(), **trainer_kwargs(max_epochs=1))
    loader = DataLoader(IndexDataset(8), batch_sampler=LengthByRank()) if model_class is WeightRecorder else None
    return records_and_error(model, lambda: trainer.fit(model, loader))


RANK_CALLS.update(
    {f"lengths by rank, {cls.__name__}": (_fit_on_lengths_by_rank, (cls,)) for cls in (WeightRecorder, DataByRank)}
)


def test_samplers_reporting_different_lengths_per_rank_fail_before_training(on_two_ranks: CallOutcomes) -> None:
    for outcome in on_two_ranks["lengths by rank, WeightRecorder"]:
        result = outcome.returned()
        assert_raised(
            result,
            r"LengthByRank does not produce the same sequence on every rank: len\(\) is 6 on rank 0 but 7 on rank 1",
        )
        assert "train/only" not in result["seen"], "training went on"


def test_module_returning_loaders_of_different_lengths_per_rank_fails_clearly(on_two_ranks: CallOutcomes) -> None:
    """Default samplers (DistributedSampler) too: without the check, 6 vs 7 steps end in a gloo error."""
    for outcome in on_two_ranks["lengths by rank, DataByRank"]:
        result = outcome.returned()
        assert_raised(result, r"len\(\) is \d+ on rank 0 but \d+ on rank 1")
        assert "train/only" not in result["seen"], "training went on"


class HandRolledLoader:
    """A loader without a dataset: any sized iterable of batches (Lightning accepts it as a train loader)."""

    batch_sampler = None  # only for the Recorder's end-of-fit report

    def __iter__(self) -> Iterator[Any]:
        return ((torch.tensor([[float(i)]]), torch.tensor([i])) for i in range(6))

    def __len__(self) -> int:
        return 6


def _fit_on_loaders_it_cannot_shard() -> Dict[str, Any]:
    """One fit whose train loaders CustomDDP hands over unchanged: a hand-rolled loader and an iterable dataset."""
    loaders = {"handrolled": HandRolledLoader(), "stream": DataLoader(_StreamThatShardsItself(), batch_size=1)}
    model = WeightRecorder()
    pl.Trainer(strategy=strategy(), **trainer_kwargs(max_epochs=1)).fit(model, train_dataloaders=loaders)
    return records(model)


RANK_CALLS["unsharded"] = (_fit_on_loaders_it_cannot_shard, ())


#: Each rank's records of the "unsharded" call, by rank.
UnshardedRun = Dict[int, Dict[str, Any]]


@pytest.fixture
def unsharded_run(on_two_ranks: CallOutcomes) -> UnshardedRun:
    """Each rank's records of the fit on loaders CustomDDP hands over unchanged."""
    return {rank: outcome.returned() for rank, outcome in enumerate(on_two_ranks["unsharded"])}


def test_loaders_that_cannot_be_sharded_are_iterated_whole_on_every_rank(unsharded_run: UnshardedRun) -> None:
    """Documented: CustomDDP shards torch DataLoaders over map-style datasets only; these run whole on every rank."""
    for rank in range(WORLD):
        seen = unsharded_run[rank]["seen"]
        assert [b for _, b in seen["train/handrolled"]] == [[i] for i in range(6)]
        assert [b for _, b in seen["train/stream"]] == [[i] for i in range(6)]
    warned = unsharded_run[0]["facts"]["warnings"]
    # named by the strategy, not by patch_dataloader_to_ddp, which its user never called
    expected = "CustomDDP: _StreamThatShardsItself is an IterableDataset; every rank iterates the loader whole"
    assert any(expected in w for w in warned), warned


def test_a_loader_that_is_not_a_dataloader_is_warned_about(unsharded_run: UnshardedRun) -> None:
    warned = unsharded_run[0]["facts"]["warnings"]
    assert any("HandRolledLoader" in w and "every rank" in w for w in warned), warned


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_drop_last_leaving_ranks_without_a_batch_is_refused(uneven: bool) -> None:
    """5 samples, batch_size=4: one batch in one process, but shares of 3 (or 2) samples on 2 ranks, which
    drop_last would leave empty: nothing would train, silently."""
    options = {"even_shares": False} if uneven else {}
    who = "rank 1" if uneven else "every rank"
    for sampler in (None, WeightedRandomSampler([1.0] * 5, 5, generator=torch.Generator().manual_seed(0))):
        loader = DataLoader(range(5), batch_size=4, drop_last=True, sampler=sampler)
        for rank in range(2):
            with pytest.raises(ValueError, match=f"drop_last=True\\) leaves {who} without a batch: the 5 samples"):
                patch_dataloader_to_ddp(loader, num_replicas=2, rank=rank, **options)
    # Left alone: a batch per rank survives, or the loader had none to begin with, or drop_last is off.
    assert len(patch_dataloader_to_ddp(DataLoader(range(8), batch_size=4, drop_last=True), 2, 0, **options)) == 1
    assert len(patch_dataloader_to_ddp(DataLoader(range(3), batch_size=4, drop_last=True), 2, 0, **options)) == 0
    assert len(patch_dataloader_to_ddp(DataLoader(range(5), batch_size=4), 2, 1, **options)) == 1
    # 7 samples: shares of 3 and 4 uneven or unpadded, of 4 padded: the error names the option that helps.
    fix = "even shares (even_shares=True; with CustomDDP, eval_mode='pad')" if uneven else (
        "padded shares (pad=True; with CustomDDP, pad_to_world_size=True)"
    )
    expected = re.escape(f"Use a smaller batch_size, drop_last=False, fewer ranks or {fix}.")
    with pytest.raises(ValueError, match=expected):
        patch_dataloader_to_ddp(DataLoader(range(7), batch_size=4, drop_last=True), 2, 0, **options, pad=False)

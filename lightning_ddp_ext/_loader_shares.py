"""What a DataLoader dealt by our sampler wrappers holds, and how much of it a rank takes.

Framework-free (torch only, no Lightning): the strategy reads loaders through these to find the wrapper that
deals them, the epoch's sampler, the size of the smallest share, and what an evaluation loader yielded.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Union

from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

from lightning_ddp_ext.consistency import SequenceDigest
from lightning_ddp_ext.dataloader import _is_plain
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper, DistributedSamplerWrapper

Wrapper = Union[DistributedBatchSamplerWrapper, DistributedSamplerWrapper]
WRAPPER_TYPES = (DistributedBatchSamplerWrapper, DistributedSamplerWrapper)

#: Wrappers of training loaders in this process: they never record what they yield (see
#: `record_yielded_in_evaluation`). Module-level, not on the strategy, which spawn pickles.
_TRAINING_WRAPPERS: "weakref.WeakSet[Wrapper]" = weakref.WeakSet()


def index_sampler(loader: object) -> object:
    """The sampler ``loader`` draws its items from: the one under torch's plain ``BatchSampler`` (or torchdata's
    copy), whether made from ``sampler=`` and ``batch_size=`` or given as ``batch_sampler=``, else
    ``loader.sampler``."""
    batching = getattr(loader, "batch_sampler", None)
    plain = batching is not None and _is_plain(batching, BatchSampler)
    return batching.sampler if plain else getattr(loader, "sampler", None)  # type: ignore[union-attr]


def wrapper_of(loader: object) -> Optional[Wrapper]:
    """Our wrapper that deals ``loader`` out: its batch sampler, or the sampler its batches are drawn from."""
    for candidate in (getattr(loader, "batch_sampler", None), index_sampler(loader)):
        if isinstance(candidate, WRAPPER_TYPES):
            return candidate
    return None


def epoch_sampler(loader: DataLoader) -> Optional[Union[Wrapper, DistributedSampler]]:
    """The sampler of ``loader`` that takes the epoch from ``CustomDDP`` (ours, or torch's DistributedSampler)."""
    wrapper = wrapper_of(loader)
    sampler = wrapper if wrapper is not None else index_sampler(loader)
    return sampler if isinstance(sampler, (*WRAPPER_TYPES, DistributedSampler)) else None


def dealt_source(loader: DataLoader) -> tuple[str, int]:
    """``(name, length)`` of what a sharded loader deals out: the user's sampler, or the dataset."""
    wrapper = wrapper_of(loader)
    if wrapper is not None:
        return type(wrapper.source).__name__, len(wrapper.source)  # type: ignore[arg-type]
    return type(loader.dataset).__name__, len(loader.dataset)  # type: ignore[arg-type]


def is_empty(loader: object) -> bool:
    """Whether ``loader`` is sized and empty (a ``val_dataloader`` returning ``[]``)."""
    try:
        return len(loader) == 0  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - unsized, or a __len__ that fails: not known to be empty
        return False


def items_per_batch(loader: DataLoader, sampler: object) -> int:
    """How many of ``sampler``'s items one of ``loader``'s batches takes: one when it is the batch sampler or
    automatic batching is off, else the batch size of the plain ``BatchSampler`` over it."""
    batching = loader.batch_sampler
    return 1 if batching is None or batching is sampler else int(getattr(batching, "batch_size"))


def items_in(batches: int, loader: DataLoader, wrapper: Wrapper) -> int:
    """The wrapper's items in ``loader``'s first ``batches`` batches."""
    return min(len(wrapper), batches * items_per_batch(loader, wrapper))


def fewest_exact_batches(loader: DataLoader, wrapper: Wrapper) -> int:
    """How many batches the rank with the smallest share of an uneven (``even_shares=False``) deal gets.

    Rank ``W - 1`` takes positions ``W - 1, 2W - 1, ...``: ``len // W`` items, the fewest. Every rank computes
    the same number from the dealt length, without communicating.
    """
    items = len(wrapper.source) // wrapper.num_replicas  # type: ignore[arg-type]
    batching = loader.batch_sampler
    if isinstance(wrapper, DistributedBatchSamplerWrapper) or batching is None:
        return items  # whole batches dealt, or automatic batching off: one item per step
    batch_size: int = getattr(batching, "batch_size")
    return items // batch_size if getattr(batching, "drop_last") else -(-items // batch_size)


def whole_epoch_digest(wrapper: Wrapper) -> Optional[SequenceDigest]:
    """``wrapper``'s last whole-epoch digest, when every rank takes it. With unequal shares (``eval_mode="exact"``)
    a rank without an item in the last round never asks for that round, so only some ranks would have it."""
    return wrapper.epoch_digest if wrapper.even_shares else None


def record_yielded_in_evaluation(wrapper: Optional[Wrapper], training: bool) -> None:
    """Have ``wrapper`` keep what it yields in evaluation, for ``evaluated_indices()`` (evaluation shares are small, a
    training epoch may not be). A loader its user dealt may serve both: training wins, whichever was set up first."""
    if wrapper is None:
        return
    if training:
        _TRAINING_WRAPPERS.add(wrapper)
    wrapper.record_yielded = not training and wrapper not in _TRAINING_WRAPPERS


def recorded_indices(wrapper: Wrapper) -> List[int]:
    """The dataset indices an evaluation ``wrapper`` recorded yielding (``record_yielded``), padding excluded."""
    real: List[Any] = wrapper.yielded[: wrapper.real_share_length()]
    if isinstance(wrapper, DistributedBatchSamplerWrapper):
        return [int(i) for batch in real for i in batch]
    return [int(i) for i in real]


def distributed_sampler_share(sampler: DistributedSampler) -> List[int]:  # type: ignore[type-arg]
    """The indices torch's ``DistributedSampler`` gives its rank, padding excluded (it is deterministic: iterating
    it again gives the same share)."""
    indices = list(sampler)
    dataset_length = len(sampler.dataset)  # type: ignore[arg-type]
    return indices[: len(range(sampler.rank, dataset_length, sampler.num_replicas))]


def samples_in_first_batches(loader: DataLoader, batches: int) -> int:
    """How many samples, padding included, ``loader``'s first ``batches`` batches held in its last iteration."""
    wrapper = wrapper_of(loader)
    if isinstance(wrapper, DistributedBatchSamplerWrapper):
        return sum(map(len, wrapper.yielded[:batches]))
    if wrapper is not None:
        return min(batches * items_per_batch(loader, wrapper), len(wrapper.yielded))
    sampler = index_sampler(loader)
    return min(batches * items_per_batch(loader, sampler), len(sampler))  # type: ignore[arg-type]

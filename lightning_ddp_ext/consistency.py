"""Check that every rank drew the same sequence from its copy of the user's sampler.

Dealing batches out by position is only a partition when every rank's sampler yields the same sequence. An
unseeded random sampler draws a different sequence on each rank: the shares then overlap, part of the data
is never seen, and nothing fails. Each wrapper keeps a cheap running :class:`SequenceDigest`;
:func:`verify_same_sequence` compares it across ranks and raises with advice instead.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Sequence

import torch.distributed as dist

from lightning_ddp_ext import _store
from lightning_ddp_ext._pickling import error_message

__all__ = [
    "SequenceDigest", "RunningDigest", "sampled_positions", "verify_same_sequence", "report_failure", "NOT_DEALT",
    "NOT_DEALT_SOURCE",
]

#: ``declared_length`` and ``sampler`` of the digest a rank sends for a loader it does not deal (an IterableDataset,
#: a loader its user sharded): it still takes part in the comparison, so that ranks that differ are told.
NOT_DEALT = -1
NOT_DEALT_SOURCE = "nothing (a loader that is not dealt: an IterableDataset, not a DataLoader, or sharded already)"

#: Items hashed in full at the start of every epoch; after that, one item in every ``_STRIDE``.
_HEAD_ITEMS = 64
_STRIDE = 64


def sampled_positions(start: int, end: int) -> range | list[int]:
    """The positions in ``[start, end)`` that the digest hashes: the first ``_HEAD_ITEMS``, then every
    ``_STRIDE``-th."""
    if end <= _HEAD_ITEMS:
        return range(start, end)
    first_strided = max(_HEAD_ITEMS, -(-start // _STRIDE) * _STRIDE)
    return [*range(start, min(end, _HEAD_ITEMS)), *range(first_strided, end, _STRIDE)]


@dataclass(frozen=True)
class SequenceDigest:
    """What a rank read from its sampler in one epoch, in a form cheap to compare across ranks.

    Attributes:
        sampler: class name of the user's sampler, for error messages.
        epoch: the epoch the sequence belongs to.
        declared_length: ``len()`` of the user's sampler for that epoch.
        items: how many items the digest covers.
        value: hash of the first items and of a regular sample of the rest.
        dealing: the wrapper's options that decide each rank's share (its seed, say): equal sequences dealt
            with different options overlap just the same.
        rank, num_replicas: the share this rank took, of how many (-1 where unknown). Not compared for equality:
            :func:`verify_same_sequence` checks that the ranks took every share equally often.
    """

    sampler: str
    epoch: int
    declared_length: int
    items: int
    value: int
    dealing: str = ""
    rank: int = field(default=-1, compare=False)
    num_replicas: int = field(default=-1, compare=False)


class RunningDigest:
    """Hashes the first ``_HEAD_ITEMS`` items of a sequence and a sample after them.

    :meth:`update` samples every ``_STRIDE``-th position; callers that read in blocks pick their own sample
    (one item per block) and pass it to :meth:`include`. Every rank must sample the same positions.

    Hashing every batch would cost as much as producing it; sampling keeps the cost near zero and still
    catches a sampler that draws differently on each rank, which differs from its first batch on. The
    hashed items are also validated: each must be an integer index or a sequence of them.
    """

    def __init__(
        self,
        sampler: str,
        epoch: int,
        declared_length: int,
        batched: bool,
        dealing: str = "",
        share: tuple[int, int] = (-1, -1),
    ) -> None:
        self._share = share  # (rank, num_replicas) of the share dealt, for the snapshots
        self._sampler = sampler
        self._epoch = epoch
        self._declared_length = declared_length
        self._batched = batched
        self._dealing = dealing
        self._value = 0
        self._items = 0

    def update(self, items: Sequence[Any], start: int) -> None:
        """Account for ``items``, which sit at positions ``start, start + 1, ...`` of the sequence."""
        self._items = start + len(items)
        for position in sampled_positions(start, self._items):
            self._value = hash((self._value, position, self._key(items[position - start], position)))

    def include(self, items: Sequence[Any], start: int) -> None:
        """Hash every one of ``items`` (positions ``start, start + 1, ...``): for callers that sample themselves."""
        for offset, item in enumerate(items):
            self._value = hash((self._value, start + offset, self._key(item, start + offset)))
        self._items = max(self._items, start + len(items))

    def include_as_read(self, positions: Iterable[int]) -> Callable[[Any], None]:
        """A callable that hashes each item it is given as the one at the next of ``positions``: for the C
        dealer, which hands its samples over as it reads them instead of keeping them for later."""
        upcoming = iter(positions)
        return lambda item: self.include((item,), next(upcoming))

    def _key(self, item: Any, position: int) -> Any:
        compact = _store._compact
        if self._batched and compact is not None:  # the common batch, a list of ints, without a Python step per
            key = compact.exact_int_tuple(item)  # index: the same tuple as below (the head's 64 batches: -45 us)
            if key is not None:
                return key
        try:
            return _store.indices_of(item, self._batched)
        except TypeError as error:
            expected = "a sequence of integer indices" if self._batched else "an integer index"
            hint = f" {error}" if isinstance(error, _store.NotIndicesError) else (
                " If it yields single indices, wrap it with DistributedSamplerWrapper instead."
                if self._batched
                else " A dataset keyed by strings is dealt by position: let the sampler yield positions 0 to"
                " len(dataset) - 1 and map them to keys in the dataset's __getitem__."
                if isinstance(item, (str, bytes))
                else " If it yields batches, wrap it with DistributedBatchSamplerWrapper instead (in a"
                " DataLoader(sampler=..., batch_size=None), pass sampler=DistributedBatchSamplerWrapper(your_sampler):"
                " patch_dataloader_to_ddp and CustomDDP leave a loader that is already dealt as it is)."
            )
            raise TypeError(
                f"{self._sampler} yielded {item!r} ({type(item).__name__}) at position {position}; each item must"
                f" be {expected}.{hint}"
            ) from None

    def snapshot(self) -> SequenceDigest:
        rank, num_replicas = self._share
        return SequenceDigest(
            self._sampler, self._epoch, self._declared_length, self._items, self._value, self._dealing, rank,
            num_replicas,
        )


def verify_same_sequence(*digests: Optional[SequenceDigest], group: Optional[Any] = None) -> None:
    """Raise RuntimeError unless every rank of ``group`` holds the same digests, in one collective, and the ranks
    take every share of each dealt sequence equally often (not all ``rank=0``, say).

    Every rank must call this at the same point with digests of the same samplers in the same order (it
    is a collective), or :func:`report_failure` in its place. ``None`` entries (a sampler not iterated yet)
    take part as they are. Does nothing when no process group is initialised, or on a rank outside ``group``.
    """
    gathered = _gather(tuple(digests), group)
    if gathered is None:
        return
    ranks = _global_ranks(group, len(gathered))  # errors name ranks as the user knows them, also in a subgroup
    failed = [(rank, sent) for rank, sent in zip(ranks, gathered) if isinstance(sent, _Failure)]
    if failed:
        rank, failure = failed[0]
        raise RuntimeError(
            f"rank {rank} failed before it could compare its samplers with the other ranks ({failure.description});"
            " every rank stops here rather than wait for it. Fix the error on that rank (see its own traceback)."
        )
    reference, first = gathered[0], ranks[0]
    for rank, others in zip(ranks, gathered):
        if len(others) != len(reference):
            raise RuntimeError(
                f"rank {first} compared {len(reference)} digest(s) but rank {rank} {len(others)}: every rank must"
                " build the same dataloaders, with the same kinds of sampler, in the same order."
            )
        for mine, theirs in zip(reference, others):
            if mine != theirs:
                raise _divergence_error(mine, theirs, rank, first)
    for position, digest in enumerate(reference):  # equal on every rank by now, None (not iterated yet) included
        if digest is None or digest.num_replicas < 1:
            continue
        taken = [others[position].rank for others in gathered]
        if _unevenly_taken(taken, digest.num_replicas):
            raise _shares_error(digest, taken, ranks)


def report_failure(error: BaseException, group: Optional[Any] = None) -> None:
    """Take part in the other ranks' :func:`verify_same_sequence` for a rank that failed before it had digests.

    Without it the others would wait in the collective until the process group's timeout and then fail with
    an error that does not name the cause; with it they raise at once, naming this rank and ``error``. The
    caller raises ``error`` itself afterwards, so this never raises: should the collective fail (a peer that
    died), ``error`` is still what the caller reports. Does nothing when no process group is initialised.
    """
    try:
        _gather(_Failure(f"{type(error).__name__}: {error_message(error)}"), group)
    except Exception:  # noqa: BLE001 - the caller's own error is the one to raise
        pass


@dataclass(frozen=True)
class _Failure:
    """What a failed rank sends in place of its digests."""

    description: str


def _gather(sent: Any, group: Optional[Any]) -> Optional[list[Any]]:
    """Every rank's ``sent``, in rank order; None when no process group is initialised or this rank is not in
    ``group``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_world_size(group)
    if ranks < 1:  # torch says -1 on a rank outside `group`: it takes no part, as in torch's own collectives
        return None
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, sent, group=group)
    return gathered


def _global_ranks(group: Optional[Any], size: int) -> List[int]:
    """The global rank of each member of ``group``, in the group's order."""
    return list(range(size)) if group is None else dist.get_process_group_ranks(group)


def _unevenly_taken(taken: List[int], num_replicas: int) -> bool:
    """Whether the shares ``taken`` by the ranks (rank ``i`` took share ``taken[i]``) miss or favour a share.

    Every share must be taken equally often: once each in plain data parallelism, ``len(taken) / num_replicas``
    times each where several ranks train on one share (a data-parallel group inside a larger one). A group of
    fewer ranks than shares (a subgroup of the ranks that deal the sampler) cannot tell, and passes."""
    if len(taken) < num_replicas:
        return False
    repeats, remainder = divmod(len(taken), num_replicas)
    return remainder != 0 or Counter(taken) != Counter({share: repeats for share in range(num_replicas)})


def _shares_error(digest: SequenceDigest, taken: List[int], ranks: List[int]) -> RuntimeError:
    """The error for shares of ``digest``'s sampler taken unevenly: ``ranks[i]`` took share ``taken[i]``."""
    by_share: dict[int, List[int]] = {}
    for rank, share in zip(ranks, taken):
        by_share.setdefault(share, []).append(rank)
    listing = "; ".join(f"share {share} on rank(s) {', '.join(map(str, on))}" for share, on in sorted(by_share.items()))
    missing = sorted(set(range(digest.num_replicas)) - set(by_share))
    lost = f" (share(s) {', '.join(map(str, missing))} on none: never trained)" if missing else ""
    return RuntimeError(
        f"the ranks deal {digest.sampler} among num_replicas={digest.num_replicas} but take its shares unevenly:"
        f" {listing}{lost}. Each rank must pass its own rank (and the number of ranks as num_replicas), e.g."
        " num_replicas=dist.get_world_size(), rank=dist.get_rank(), or leave both to the process group."
    )


def _divergence_error(
    reference: Optional[SequenceDigest], other: Optional[SequenceDigest], rank: int, reference_rank: int = 0
) -> RuntimeError:
    """The error for ``rank``'s digest ``other`` differing from ``reference``, that of ``reference_rank``."""
    first, second = f"rank {reference_rank}", f"rank {rank}"
    known = reference or other
    assert known is not None
    if reference is not None and other is not None:
        kinds = [NOT_DEALT_SOURCE if d.declared_length == NOT_DEALT else d.sampler for d in (reference, other)]
        if kinds[0] != kinds[1]:
            return RuntimeError(
                f"the ranks' loaders differ: {first} deals {kinds[0]} but {second} deals {kinds[1]}, so they would"
                " step different numbers of times or on overlapping data. Give every rank the same kind of loader,"
                " with the same kind of sampler, in the same order."
            )
    if known.declared_length == NOT_DEALT and (reference is None or other is None):
        return RuntimeError(
            f"the ranks are out of step: {first} and {second} compare different loaders here (they build different"
            " numbers or kinds of loaders). Give every rank the same loaders, in the same order."
        )
    if reference is not None and other is not None and other.declared_length == reference.declared_length:
        if other.epoch != reference.epoch:
            return RuntimeError(
                f"the ranks deal {known.sampler} for different epochs: epoch {reference.epoch} on {first} but"
                f" {other.epoch} on {second}, so their shares may come from different orders (wherever the epoch seeds"
                " the order) and overlap. Call"
                " set_epoch(epoch) with the same epoch on every rank before each epoch (on"
                " loader.batch_sampler.sampler, or on loader.sampler when loader.batch_sampler is None)."
            )
        if other.dealing != reference.dealing:
            return RuntimeError(
                f"the ranks deal {known.sampler} out with different options: {reference.dealing} on {first} but"
                f" {other.dealing} on {second}. Each rank keeps its own positions of one dealt sequence, so"
                " the options must be the same on every rank (a seed that differs per rank makes the shares"
                " overlap): pass the same num_replicas, shuffle, seed, shuffle_window, pad and even_shares on every"
                " rank."
            )
    if reference is None or other is None:
        what = f"it was iterated on one of {first} and {second} but not on the other"
    elif other.declared_length != reference.declared_length:
        what = f"len() is {reference.declared_length} on {first} but {other.declared_length} on {second}"
    else:
        what = f"the sequences it yielded in epoch {reference.epoch} differ between {first} and {second}"
    return RuntimeError(
        f"{known.sampler} does not produce the same sequence on every rank: {what}. Each rank keeps every W-th"
        " item of that sequence, so different sequences overlap and part of the data is never seen. Seed the"
        " sampler identically on every rank (for example pass a torch.Generator seeded with the same number, and"
        " derive per-epoch randomness from seed + epoch in set_epoch), and give it the same data on every rank."
        " A sampler whose state changes during training (curriculum levels, hard-negative weights) must get the"
        " same change on every rank: compute it from values gathered from all ranks, not from one rank's own."
        " If it already gives each rank its own share (it reads the rank), it must not be dealt again: pass"
        " Trainer(use_distributed_sampler=False) under Lightning, or leave patch_dataloader_to_ddp out in plain"
        " PyTorch."
    )

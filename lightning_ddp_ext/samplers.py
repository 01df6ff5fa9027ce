"""Deal a user's (batch) sampler out among ranks without rebuilding it.

Stock tools either re-instantiate a batch sampler with a ``DistributedSampler`` injected (which silently
changes samplers that build their own batches) or materialise the whole epoch as Python lists on every rank.
The wrappers here iterate the user's object once per epoch, unchanged, and keep every W-th item:

    sequence of the epoch:  b0 b1 b2 b3 b4 b5 b6      (W = 3, pad=True)
    padded to a multiple:   b0 b1 b2 b3 b4 b5 b6 b0 b1
    rank 0 yields           b0       b3       b6
    rank 1 yields              b1       b4       b0
    rank 2 yields                 b2       b5       b1

With ``shuffle=False`` a rank holds one round of W items at a time; with ``shuffle_window=K`` it permutes
consecutive windows of K*W items and holds one window; only ``shuffle=True, shuffle_window=None`` needs
the whole epoch, and then each rank keeps just its own share, compactly (see ``_store``).

No Lightning import here: the wrappers work with plain ``torch.distributed``.
"""
from __future__ import annotations

from itertools import chain, compress, count, islice
from operator import itemgetter
from typing import Any, Generic, Iterable, Iterator, List, Optional, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_ddp_ext._store import CompactStore
from lightning_ddp_ext.consistency import RunningDigest, SequenceDigest, sampled_positions

__all__ = ["DistributedBatchSamplerWrapper", "DistributedSamplerWrapper", "LengthMismatchError"]

T = TypeVar("T")

# Rounds (of W items) read at once when streaming: large enough that per-block work vanishes per item.
_BLOCK_ROUNDS = 16
# Rounds the unshuffled path deals in C between two Python steps (each hashes one round for the digest).
_CHUNK_ROUNDS = 256
# Leading items the unshuffled path reads in Python (the digest hashes the first items in full).
_HEAD_ITEMS = 64
# Windows whose permutations are drawn in one call grow 1, 2, 4, ... up to this many elements, so that the
# first batch costs one tiny draw whatever the epoch's length.
_MAX_PERMUTATION_ELEMENTS = 1 << 16


class LengthMismatchError(RuntimeError):
    """The user's sampler yielded a different number of items than its ``len()`` announced."""


def _resolve_world(num_replicas: Optional[int], rank: Optional[int], owner: str) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{owner} needs num_replicas and rank: pass them explicitly, or initialise the default process"
                " group (torch.distributed.init_process_group) before creating it."
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"{owner}: num_replicas must be an integer >= 1, got {num_replicas!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"{owner}: rank must be an integer in [0, {num_replicas - 1}], got {rank!r}.")
    return num_replicas, rank


def _fewer_items_than_ranks(what: str, world: int) -> ValueError:
    """The error for ``pad=False`` with fewer items than ranks; ``what`` says what has how many items."""
    return ValueError(
        f"{what}, fewer than the {world} ranks, and pad=False drops the incomplete round: every rank would get"
        " nothing. Use pad=True, fewer ranks, or more data."
    )


class _DealingWrapper(Sampler[T], Generic[T]):
    """Everything both wrappers share; subclasses only say whether items are batches or indices."""

    _batched: bool

    def __init__(
        self,
        source: Iterable[Any],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = False,
        seed: int = 0,
        pad: bool = True,
        shuffle_window: Optional[int] = None,
        even_shares: bool = True,
    ) -> None:
        owner = type(self).__name__
        if not hasattr(source, "__len__") or not hasattr(source, "__iter__"):
            raise TypeError(
                f"{owner} needs an iterable with __len__, got {type(source).__name__}: every rank must know the"
                " number of items in advance to take equal shares. Add a __len__ that returns how many items"
                " one epoch yields (or use an IterableDataset that shards itself)."
            )
        if shuffle_window is not None and (
            isinstance(shuffle_window, bool) or not isinstance(shuffle_window, int) or shuffle_window < 1
        ):
            raise ValueError(f"{owner}: shuffle_window must be None or an integer >= 1, got {shuffle_window!r}.")
        self.source = source
        self.num_replicas, self.rank = _resolve_world(num_replicas, rank, owner)
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.shuffle_window = shuffle_window
        self.even_shares = even_shares
        self.epoch = 0
        self._resume: Optional[tuple[int, int]] = None
        #: When True, every item yielded in the current epoch is kept in :attr:`yielded` (for evaluation).
        self.record_yielded = False
        self.yielded: List[T] = []
        self._source_name = type(source).__name__
        self._head_digest: Optional[SequenceDigest] = None
        self._epoch_digest: Optional[SequenceDigest] = None
        self._plan(self._declared_length())  # fail early on an empty or too short source

    # ------------------------------------------------------------------ sizes
    def _declared_length(self) -> int:
        length = len(self.source)  # type: ignore[arg-type]
        if length < 1:
            raise ValueError(
                f"{self._source_name} is empty (len() == 0): there is nothing to deal out among"
                f" {self.num_replicas} ranks. Check the dataset and the sampler's arguments."
            )
        return length

    def _plan(self, length: int) -> int:
        """Return how many positions the dealt sequence has (a multiple of num_replicas when even)."""
        world = self.num_replicas
        if not self.even_shares:
            return length
        if self.pad:
            return -(-length // world) * world
        if length < world:
            raise _fewer_items_than_ranks(f"{self._source_name} yields {length} item(s) per epoch", world)
        return length // world * world

    def __len__(self) -> int:
        return len(range(self.rank, self._plan(self._declared_length()), self.num_replicas))

    def real_share_length(self) -> int:
        """How many of this rank's items this epoch are the sampler's own, not padding repeats.

        Without shuffling, padding only ever fills the last round, so these are the first items yielded.
        """
        if self.shuffle:
            raise ValueError("real_share_length() needs shuffle=False: shuffling moves padding into the sequence.")
        return len(range(self.rank, min(self._declared_length(), self._plan(self._declared_length())), self.num_replicas))

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (it seeds the shuffle) and forward it to the user's sampler.

        Forwarded to ``source.set_epoch`` and, for a batch sampler, to ``source.sampler.set_epoch`` when
        they exist: the calls a single-process Lightning loop would have made.
        """
        self.epoch = epoch
        targets: dict[int, Any] = {}
        for candidate in (self.source, getattr(self.source, "sampler", None) if self._batched else None):
            set_epoch = getattr(candidate, "set_epoch", None)
            if candidate is not None and callable(set_epoch):
                targets[id(candidate)] = set_epoch
        for set_epoch in targets.values():
            set_epoch(epoch)

    @property
    def head_digest(self) -> Optional[SequenceDigest]:
        """Digest of the first window of the current epoch, available once the first item was yielded."""
        return self._head_digest

    @property
    def epoch_digest(self) -> Optional[SequenceDigest]:
        """Digest of the last epoch that was iterated to its end."""
        return self._epoch_digest

    # ------------------------------------------------------------------ iteration
    def resume_within_epoch(self, epoch: int, done: int) -> None:
        """Make the next iteration, if it is of ``epoch``, skip this rank's first ``done`` items.

        For a restart from a mid-epoch checkpoint: those items were trained before it was written. The user's
        sampler is still iterated whole (the sequence, and so every rank's share, stays the same); only the
        yield of the first ``done`` items is skipped. Applies once; ``len()`` is unchanged.
        """
        if not 0 <= done <= len(self):
            raise ValueError(f"done must be in [0, {len(self)}] (this rank's items per epoch), got {done}.")
        self._resume = (epoch, done)

    def __iter__(self) -> Iterator[T]:
        # The work is done per block by generators that yield lists; chain.from_iterable walks each list in C,
        # so an item costs no Python frame at all (the floor is the user's sampler, at about 1 us a batch).
        items = chain.from_iterable(self._own_blocks())
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] == self.epoch and resume[1] > 0:
            return islice(items, resume[1], None)
        return items

    def _own_blocks(self) -> Iterator[Iterable[T]]:
        """This rank's items of the epoch, as consecutive lists."""
        length = self._declared_length()
        total = self._plan(length)
        digest = RunningDigest(self._source_name, self.epoch, length, self._batched)
        self._head_digest = None
        self.yielded = []
        generator = torch.Generator().manual_seed(self.seed + self.epoch) if self.shuffle else None
        blocks: Iterator[Iterable[T]]
        if generator is None:
            blocks = self._unshuffled_blocks(length, total, digest)
        elif self.shuffle_window is None:
            blocks = self._full_shuffle_blocks(length, total, digest, generator)
        else:
            window = self.num_replicas * (self.shuffle_window or 1)
            blocks = self._window_blocks(length, total, window, digest, generator)
        for block in blocks:
            if self.record_yielded:
                block = list(block)  # blocks may be one-shot iterators
                self.yielded.extend(block)
            yield block
        self._epoch_digest = digest.snapshot()

    def _mismatch(self, length: int, produced: int) -> LengthMismatchError:
        return LengthMismatchError(
            f"{self._source_name}.__len__() returned {length} but iterating it produced {produced} item(s) in"
            f" epoch {self.epoch}. Ranks step in lock-step on len(), so a wrong __len__ makes DDP hang or drop data:"
            f" make __len__ return exactly the number of items __iter__ yields for the current epoch."
        )

    def _unshuffled_blocks(self, length: int, total: int, digest: RunningDigest) -> Iterator[Iterable[T]]:
        """Deal the sequence round by round without shuffling: rank r keeps item r of every round of W.

        Three stages: the first rounds in Python (they feed the digest's head and the padding), the middle
        rounds in C (``zip`` groups the stream into rounds, ``itemgetter`` keeps this rank's item, so the
        other ranks' items are freed at once), with one round per chunk hashed, and the last round in Python
        (length check, padding). ``zip`` only emits complete rounds, so every rank yields the same number of
        items even when the sampler runs out early.
        """
        world, rank = self.num_replicas, self.rank
        counter = count()
        counted = map(itemgetter(0), zip(self.source, counter))  # items unchanged; `counter` counts them in C
        final_start = (total - 1) // world * world  # first position of the last round
        head_end = min(final_start, -(-_HEAD_ITEMS // world) * world)
        head: List[Any] = []
        for start, end in ((0, min(world, head_end)), (world, head_end)):  # one round first: a fast first item
            if end <= start:
                continue
            block = list(islice(counted, end - start))
            if len(block) < end - start:
                raise self._mismatch(length, start + len(block))
            digest.update(block, start)
            head.extend(block)
            self._head_digest = digest.snapshot()
            yield block[rank::world]
        rounds = zip(*[counted] * world)
        pick = itemgetter(rank)
        position = head_end
        while position < final_start:
            chunk = min(_CHUNK_ROUNDS, (final_start - position) // world)
            yield map(pick, islice(rounds, chunk - 1))
            last = next(rounds, None)
            if last is None:
                raise self._mismatch(length, next(counter))
            digest.include(last, position + (chunk - 1) * world)
            position += chunk * world
            yield (last[rank],)
        final = list(islice(counted, max(0, length - final_start)))
        extra = sum(1 for _ in counted)
        if final_start + len(final) + extra != length:
            raise self._mismatch(length, final_start + len(final) + extra)
        digest.update(final, final_start)
        source_of_padding = head or final
        last_round = final[: total - final_start] + [
            source_of_padding[(p - length) % len(source_of_padding)] for p in range(max(length, final_start), total)
        ]
        if not head_end:
            self._head_digest = digest.snapshot()
        yield last_round[rank::world]

    def _window_blocks(
        self,
        length: int,
        total: int,
        window: int,
        digest: RunningDigest,
        generator: Optional[torch.Generator],
    ) -> Iterator[Iterable[T]]:
        """Read whole windows, optionally permute each, and keep every W-th item.

        Items are read in blocks of 1, 2, 4, ... windows (up to about ``_BLOCK_ROUNDS`` rounds), so the
        first item comes after one window while the per-item cost stays that of slicing a list. A block is
        only dealt once it was read completely, so every rank yields the same number of items even when the
        sampler runs out early; the length is checked before the last block.
        """
        world, rank = self.num_replicas, self.rank
        iterator = iter(self.source)
        pad_count = total - length
        head: List[Any] = []  # the first items, kept to pad the last round
        permutations = _window_permutations(total, window, world, rank, generator) if generator else None
        windows_per_block, most_windows = 1, max(1, _BLOCK_ROUNDS * world // window)
        start = 0
        while start < total:
            size = min(window * windows_per_block, total - start)
            real = max(0, min(size, length - start))
            block = list(islice(iterator, real))
            if len(block) < real:
                raise self._mismatch(length, start + len(block))
            digest.update(block, start)
            if len(head) < pad_count:
                head.extend(block[: pad_count - len(head)])
            if start + size >= total:  # last block: the sampler must end exactly at `length`
                remaining = sum(1 for _ in iterator)
                if start + real + remaining != length:
                    raise self._mismatch(length, start + real + remaining)
                block.extend(head[(position - length) % len(head)] for position in range(start + real, start + size))
            if start == 0:
                self._head_digest = digest.snapshot()
            if permutations is None:
                yield block[rank::world]
            else:
                for offset in range(0, size, window):
                    yield list(map(block.__getitem__, [offset + p for p in next(permutations)]))
            start += size
            windows_per_block = min(2 * windows_per_block, most_windows)

    def _full_shuffle_blocks(
        self, length: int, total: int, digest: RunningDigest, generator: torch.Generator
    ) -> Iterator[Iterable[T]]:
        """Shuffle the whole epoch: read it all, keeping only this rank's share, compactly.

        The permutation depends only on ``seed + epoch`` and the length, so a rank knows before reading which
        positions it needs; ``itertools.compress`` then picks them (and the digest's sample positions) out of
        the sampler's stream in C, and only those are stored.
        """
        world, rank = self.num_replicas, self.rank
        own_positions = torch.randperm(total, generator=generator)[rank::world].numpy()
        # Padding positions repeat the start of the sequence.
        own_sources = np.where(own_positions < length, own_positions, (own_positions - length) % length)
        needed_sources, slot_of_position = np.unique(own_sources, return_inverse=True)
        needed = np.zeros(length, dtype=np.bool_)
        needed[needed_sources] = True
        sampled = np.zeros(length, dtype=np.bool_)
        sampled[sampled_positions(0, length)] = True
        selected = needed | sampled
        selected_positions = np.flatnonzero(selected).tolist()
        keep_flags = needed[selected].tolist()
        sample_flags = sampled[selected].tolist()
        counter = count()
        counted = map(itemgetter(0), zip(self.source, counter))  # counts what the sampler yields, in C
        store = CompactStore(batched=self._batched, owner=self._source_name)
        for k, item in enumerate(compress(counted, selected.tobytes())):
            if keep_flags[k]:
                store.append(item)
            if sample_flags[k]:
                digest.update((item,), selected_positions[k])
        produced = next(counter) + sum(1 for _ in counted)
        if produced != length:
            raise self._mismatch(length, produced)
        digest.update((), length)
        self._head_digest = digest.snapshot()
        yield from store.blocks_in_order(slot_of_position.reshape(-1).tolist())  # type: ignore[misc]


def _window_permutations(
    total: int, window: int, world: int, rank: int, generator: torch.Generator
) -> Iterator[List[int]]:
    """Yield, window by window, the positions this rank takes from each permuted window.

    Permutations are drawn in growing batches of windows (argsort of uniform keys), so the first costs
    little; every rank draws the same numbers in the same order, whatever its rank.
    """
    full_windows, last = divmod(total, window)
    batch = 1
    done = 0
    while done < full_windows:
        count = min(batch, full_windows - done)
        keys = torch.rand((count, window), generator=generator)
        yield from keys.argsort(dim=1)[:, rank::world].tolist()
        done += count
        batch = min(batch * 2, max(1, _MAX_PERMUTATION_ELEMENTS // window))
    if last:
        yield torch.randperm(last, generator=generator)[rank::world].tolist()


class DistributedBatchSamplerWrapper(_DealingWrapper[List[int]]):
    """Deal the batches of any batch sampler out among ranks, each batch unchanged.

    Rank ``r`` of ``W`` yields batches ``r, r + W, r + 2W, ...`` of the sequence the user's batch sampler
    yields this epoch. The user's object is only iterated, never rebuilt or modified, so samplers that build
    batches themselves (P x K class-balanced, length buckets, token budgets) keep their batches.

    Args:
        batch_sampler: any iterable of index sequences with ``__len__``; it need not subclass BatchSampler.
        num_replicas: number of ranks W; defaults to the world size of the default process group.
        rank: this rank; defaults to the rank in the default process group.
        shuffle: permute the batch order before dealing, seeded by ``seed + epoch`` (same on every rank).
        seed: base seed of that permutation.
        pad: True repeats batches from the start of the epoch's sequence so every rank gets
            ``ceil(len / W)`` batches; False drops the incomplete last round (``len // W`` each).
        shuffle_window: with ``shuffle=True``, permute within consecutive windows of ``shuffle_window * W``
            batches and stream; None shuffles the whole epoch, which must then be read before the first batch.
        even_shares: False gives rank ``r`` exactly the positions ``r, r + W, ...`` of the sequence, neither
            padded nor dropped, so ranks may get one item more or less: for exact evaluation only, where
            ranks need not step in lock-step (``pad`` is then ignored).

    Example:
        >>> batches = [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
        >>> [list(DistributedBatchSamplerWrapper(batches, num_replicas=2, rank=r)) for r in range(2)]
        [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [0, 1]]]

    .. warning::
        Every rank must iterate an identically seeded copy of the sampler, or the shares overlap: compare
        :attr:`head_digest` across ranks with :func:`lightning_ddp_ext.consistency.verify_same_sequence`.
        Call :meth:`set_epoch` before each epoch when shuffling, as with ``DistributedSampler``.
    """

    _batched = True

    def __init__(
        self,
        batch_sampler: Iterable[Sequence[int]],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = False,
        seed: int = 0,
        pad: bool = True,
        shuffle_window: Optional[int] = None,
        even_shares: bool = True,
    ) -> None:
        super().__init__(batch_sampler, num_replicas, rank, shuffle, seed, pad, shuffle_window, even_shares)
        self.sampler = _EpochRelay(self)

    @property
    def batch_sampler(self) -> Iterable[Sequence[int]]:
        """The user's batch sampler, unchanged."""
        return self.source


class DistributedSamplerWrapper(_DealingWrapper[int]):
    """Deal the indices of any index sampler out among ranks (each rank gets a disjoint share).

    The same algorithm as :class:`DistributedBatchSamplerWrapper`, for samplers that yield single indices
    (weighted, curriculum, or hard-negative samplers). Arguments are the same, with indices for batches.

    Example:
        >>> [list(DistributedSamplerWrapper(range(5), num_replicas=2, rank=r, pad=False)) for r in range(2)]
        [[0, 2], [1, 3]]
    """

    _batched = False

    def __init__(
        self,
        sampler: Iterable[int],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = False,
        seed: int = 0,
        pad: bool = True,
        shuffle_window: Optional[int] = None,
        even_shares: bool = True,
    ) -> None:
        super().__init__(sampler, num_replicas, rank, shuffle, seed, pad, shuffle_window, even_shares)

    @property
    def sampler(self) -> Iterable[int]:
        """The user's sampler, unchanged."""
        return self.source


class _EpochRelay:
    """Exposed as ``wrapper.sampler`` so that loops calling ``loader.batch_sampler.sampler.set_epoch(e)``
    (Lightning's, accelerate's) reach the wrapper: they never call ``set_epoch`` on the batch sampler itself.
    """

    def __init__(self, wrapper: DistributedBatchSamplerWrapper) -> None:
        self._wrapper = wrapper

    def set_epoch(self, epoch: int) -> None:
        self._wrapper.set_epoch(epoch)

    def __repr__(self) -> str:
        return f"_EpochRelay(to={type(self._wrapper).__name__} over {self._wrapper._source_name})"

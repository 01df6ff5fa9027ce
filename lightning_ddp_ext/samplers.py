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
consecutive windows of K*W items and holds one window (see ``_windows``); only ``shuffle=True,
shuffle_window=None`` needs the whole epoch, and then each rank keeps just its own share, compactly (see
``_store``).

No Lightning import here: the wrappers work with plain ``torch.distributed``.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from itertools import chain, compress, islice
from operator import itemgetter, length_hint
from typing import Any, Callable, Generic, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import torch
from torch.utils.data import Sampler

from lightning_ddp_ext import _attributes, _store
from lightning_ddp_ext._checks import (
    check_flag,
    check_seed,
    check_shuffle_window,
    fewer_items_than_ranks,
    integer_or_none,
    length_of,
    nothing_to_deal,
    resolve_world,
)
from lightning_ddp_ext._store import KEEP, STORE, CompactStore
from lightning_ddp_ext._windows import PlanSpan, last_round_start, plan_ranges, sampled_block_ends, window_plan
from lightning_ddp_ext.consistency import RunningDigest, SequenceDigest

__all__ = ["DistributedBatchSamplerWrapper", "DistributedSamplerWrapper", "LengthMismatchError"]

T = TypeVar("T")

# Own items per block of windows: the windowed shuffle's unit of Python work (and of the digest's samples).
# Without the C helper a rank holds a whole block: a held item's memory stays in the core's caches only
# while few are alive at once, and holding about a hundred batches costs a few percent over freeing each
# at once, a thousand nearly double the epoch (measured in benchmarks/sampler_overhead.py). The helper
# holds one window at a time, whatever the block.
_WINDOW_BLOCK_ITEMS = 128
# Rounds of the unshuffled path per digest sample (its last item), and per chunk dealt without the C helper.
_CHUNK_ROUNDS = 1024
# Positions between two digest samples of the windowed shuffle, at least: a sample costs about 3 us to hash,
# the user's sampler about 0.7 us per position.
_SAMPLE_SPACING = 1024
# Leading items the unshuffled path reads in Python (the digest hashes the first items in full).
_HEAD_ITEMS = 64
# Positions the whole-epoch shuffle reads per block: a few Python steps per block, and one digest sample.
_READ_BLOCK = 1024
# Positions per window at most (shuffle_window * num_replicas): the permutations draw 32-bit positions.
_MAX_WINDOW = 1 << 31

# The epoch a wrapper last forwarded to each user sampler, by id while the sampler lives (weakly; one that takes
# no weak reference is not remembered): a new wrapper around a sampler that an earlier wrapper moved on (a
# tuner's run before the fit, say) must set its epoch again before it is iterated, even at its own epoch.
_EPOCHS_FORWARDED: dict[int, Tuple["weakref.ref[Any]", int]] = {}


def _epoch_forwarded_to(source: object) -> Optional[int]:
    """The epoch a wrapper last forwarded to ``source`` (to its ``set_epoch`` or its inner sampler's); None when
    none did, or when ``source`` takes no weak reference."""
    entry = _EPOCHS_FORWARDED.get(id(source))
    return entry[1] if entry is not None and entry[0]() is source else None


def _remember_epoch_forwarded(source: object, epoch: int) -> None:
    key = id(source)

    def forget(ref: "weakref.ref[Any]") -> None:
        if _EPOCHS_FORWARDED.get(key, (None, 0))[0] is ref:  # not a later object's entry under a reused id
            del _EPOCHS_FORWARDED[key]

    try:
        _EPOCHS_FORWARDED[key] = (weakref.ref(source, forget), epoch)
    except TypeError:  # no weak reference to it (``__slots__`` without ``__weakref__``)
        _EPOCHS_FORWARDED.pop(key, None)


class LengthMismatchError(RuntimeError):
    """The user's sampler yielded a different number of items than its ``len()`` announced."""


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
        if not hasattr(source, "__len__"):
            raise TypeError(
                f"{owner} needs an iterable with __len__, got {type(source).__name__}: every rank must know the"
                " number of items in advance to take equal shares. Add a __len__ that returns how many items"
                " one epoch yields (or use an IterableDataset that shards itself)."
            )
        if not hasattr(source, "__iter__") and not hasattr(source, "__getitem__"):  # as iter() decides
            raise TypeError(
                f"{owner} needs an iterable with __len__, got {type(source).__name__}, which has __len__ but"
                " cannot be iterated. Give it an __iter__ that yields one epoch's items."
            )
        shuffle_window = check_shuffle_window(shuffle_window, owner)
        shuffle, pad = check_flag(shuffle, "shuffle", owner), check_flag(pad, "pad", owner)
        even_shares = check_flag(even_shares, "even_shares", owner)
        seed = check_seed(seed, owner)
        self.source = source
        self.num_replicas, self.rank = resolve_world(num_replicas, rank, owner)
        if shuffle_window is not None and shuffle_window * self.num_replicas > _MAX_WINDOW:
            raise ValueError(
                f"{owner}: shuffle_window={shuffle_window} makes windows of {shuffle_window * self.num_replicas}"
                f" positions on {self.num_replicas} ranks, more than the {_MAX_WINDOW} a window may have. To shuffle"
                " across the whole epoch, pass shuffle_window=None."
            )
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.shuffle_window = shuffle_window
        self.even_shares = even_shares
        self.epoch = 0
        self._epoch_set_ahead: Optional[Tuple[int, int]] = None  # see _set_epoch_ahead_of_loop
        # Set by CustomDDP on a training loader's wrapper: the epoch to deal when the loop calls set_epoch(epoch).
        self._loop_epoch_to_deal: Optional[Callable[[int], int]] = None
        #: When False, :meth:`set_epoch` leaves out the user's batch sampler itself (see there).
        self.forward_epoch_to_batch_sampler = True
        self._resume: Optional[tuple[int, Union[int, Callable[[], int]]]] = None
        #: When True, every item yielded in the current epoch is kept in :attr:`yielded` (for evaluation).
        self.record_yielded = False
        self.yielded: List[T] = []
        self._source_name = type(source).__name__
        self._head_digest: Optional[SequenceDigest] = None
        self._epoch_digest: Optional[SequenceDigest] = None
        self._plan(self._declared_length())  # fail early on an empty or too short source

    # ------------------------------------------------------------------ the user's settings, through the wrapper
    # The wrapper's own attributes are in its __dict__ once its __init__ (own code, see __setattr__) set them.
    #: Not read through: Lightning takes a batch sampler that has the first two for one it can rebuild around a
    #: sampler of its own, which a wrapper is not; torchdata takes one with the last two for one that restores
    #: its own position (a wrapper resumes through its loader).
    _NOT_FORWARDED = frozenset({"batch_size", "drop_last", "state_dict", "load_state_dict"})

    def _forwards(self, name: str) -> bool:
        """Whether ``name`` is a data attribute of the user's object (see :func:`_attributes.is_data_attribute`)
        that the wrapper reads and writes through: none of the wrapper's own, nor one it leaves alone."""
        if name.startswith("_") or name in self._NOT_FORWARDED:
            return False
        if name in self.__dict__ or _attributes.found_on_class(type(self), name):
            return False
        return _attributes.is_data_attribute(self.__dict__.get("source"), name)

    def __getattr__(self, name: str) -> Any:
        """The user's object's data attributes read through the wrapper, as on one device, where the loader holds
        the user's object itself (a callback that reads ``trainer.train_dataloader.batch_sampler.limit``)."""
        if _attributes.found_on_class(type(self), name):  # a property of ours that raised AttributeError inside:
            return object.__getattribute__(self, name)  # raise its own error, not "no attribute"
        if self._forwards(name):
            return getattr(self.__dict__["source"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{self._not_forwarded(name)}")

    def _not_forwarded(self, name: str) -> str:
        """Where to reach ``name`` when the user's object has it but the wrapper does not read it through."""
        source = self.__dict__.get("source")
        if name not in self._NOT_FORWARDED or not hasattr(source, name):
            return ""
        return (
            f": {self._source_name}'s {name} is not read or set through the wrapper (Lightning and torchdata would"
            f" take the wrapper for an object they may rebuild or restore). Reach it on your object itself,"
            f" wrapper.source.{name} (loader.batch_sampler.batch_sampler or loader.sampler.sampler)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a data attribute of the user's object through the wrapper (a curriculum callback raising
        ``batch_sampler.limit``): set on the wrapper, it would change nothing, silently.

        Set on the wrapper instead: its own attributes, names the user's object does not have, and whatever the
        code of the wrapper's class or a subclass sets (its ``__init__`` setting ``self.generator``, say). Such an
        attribute then hides the user's of the same name for reads and writes through the wrapper too. Except
        ``sampler``, the relay of a batch-sampler wrapper: ``wrapper.sampler = s`` sets the user's batch sampler's
        own ``sampler``, as ``batch_sampler.sampler = s`` does on one device (replacing the relay changed nothing
        for the batches and cut the loop's ``set_epoch`` off from the wrapper).
        """
        forwarded = self._forwards(name)
        relayed = name == "sampler" and isinstance(self.__dict__.get("sampler"), _EpochRelay)
        users = forwarded or relayed or name in self._NOT_FORWARDED
        if users and sys._getframe(1).f_code in _attributes.code_of_methods(type(self), _DealingWrapper):
            forwarded = relayed = False  # the wrapper's own code, or a subclass's, sets its own attribute
        elif name in self._NOT_FORWARDED and not (
            name in self.__dict__ or _attributes.found_on_class(type(self), name)
        ):
            hint = self._not_forwarded(name)  # set on the wrapper, the user's batch_size (say) would not change
            if hint:
                raise AttributeError(f"cannot set {name!r} on {type(self).__name__}{hint}.")
        if relayed:
            self.__dict__["sampler"]._replace_users_sampler(value)
        elif forwarded:
            setattr(self.__dict__["source"], name, value)
        else:
            super().__setattr__(name, value)

    # ------------------------------------------------------------------ sizes
    def _declared_length(self) -> int:
        length = length_of(
            self.source,
            f"len() of {self._source_name}",
            "Every rank must know the number of items in advance to take equal shares: make __len__ return how many"
            " items one epoch yields.",
        )
        if length < 1:
            raise nothing_to_deal(self._source_name, self.num_replicas)
        return length

    def _plan(self, length: int) -> int:
        """Return how many positions the dealt sequence has (a multiple of num_replicas when even)."""
        world = self.num_replicas
        if not self.even_shares:
            return length
        if self.pad:
            return -(-length // world) * world
        if length < world:
            raise fewer_items_than_ranks(f"{self._source_name} yields {length} item(s) per epoch", world)
        return length // world * world

    def __len__(self) -> int:
        return len(range(self.rank, self._plan(self._declared_length()), self.num_replicas))

    def real_share_length(self) -> int:
        """How many of this rank's items this epoch are the sampler's own, not padding repeats.

        Without shuffling, padding only ever fills the last round, so these are the first items yielded; uneven
        shares (``even_shares=False``) have no padding at all, shuffled or not.
        """
        if not self.even_shares:
            return len(self)
        if self.shuffle:
            raise ValueError("real_share_length() needs shuffle=False: shuffling moves padding into the sequence.")
        declared = self._declared_length()
        return len(range(self.rank, min(declared, self._plan(declared)), self.num_replicas))

    def _dealing_options(self) -> str:
        """The options that decide which positions are this rank's: every rank must deal with the same ones (the
        seed and window only matter when shuffling), or shares overlap even when the sequences agree."""
        options = f"num_replicas={self.num_replicas}, shuffle={self.shuffle}"  # pad matters to even shares only
        options += f", pad={self.pad}, even_shares=True" if self.even_shares else ", even_shares=False"
        if self.shuffle:
            options += f", seed={self.seed}, shuffle_window={self.shuffle_window}"
        return options

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (it seeds the shuffle) and forward it to the user's sampler.

        Forwarded to ``source.set_epoch`` and, for a batch sampler, to ``source.sampler.set_epoch`` when
        they exist, as a training loop calls torch's ``DistributedSampler``. A single-process Lightning loop
        reaches only the second; with :attr:`forward_epoch_to_batch_sampler` False (``CustomDDP`` under
        ``overfit_batches``, which must train the same batches every epoch) so does this. Every call is
        forwarded, as a loop makes it (Lightning's sets a validation loader's epoch before every validation run),
        except a repeat that ``CustomDDP`` announced (it sets the epoch before the loop does). A numpy or torch
        integer is taken as the int it is; anything else is a TypeError here, not at the next epoch's shuffle.
        """
        checked = integer_or_none(epoch)
        if checked is None:
            raise TypeError(f"{type(self).__name__}.set_epoch takes an integer epoch, got {epoch!r}")
        epoch = checked
        ahead, self._epoch_set_ahead = self._epoch_set_ahead, None
        if ahead is not None and epoch == ahead[0]:
            self.epoch = ahead[1]
            return
        numbering = self.__dict__.get("_loop_epoch_to_deal")
        if numbering is not None:
            epoch = numbering(epoch)
        self.epoch = epoch
        self._forward_epoch(epoch)

    def _forward_epoch(self, epoch: int) -> None:
        targets: dict[int, Any] = {}
        own = self.source if self.forward_epoch_to_batch_sampler or not self._batched else None
        for candidate in (own, getattr(self.source, "sampler", None) if self._batched else None):
            set_epoch = getattr(candidate, "set_epoch", None)
            if candidate is not None and callable(set_epoch):
                targets[id(candidate)] = set_epoch
        for set_epoch in targets.values():
            set_epoch(epoch)
        if targets:
            _remember_epoch_forwarded(self.source, epoch)

    def _set_epoch_ahead_of_loop(self, epoch: int, dealt_as: Optional[int] = None, forwarded: bool = False) -> None:
        """:meth:`set_epoch` now, on behalf of a loop that will call ``set_epoch(epoch)`` itself before the epoch:
        that call then sets nothing again, so a sampler whose ``set_epoch`` advances a curriculum sees the epoch
        once. ``CustomDDP`` sets the epoch before Lightning's loop does (a loader with workers draws its first
        indices as soon as its iterator is made). With ``dealt_as``, the epoch is dealt (and forwarded) as that
        one instead, and the loop's call keeps it: the rest of an epoch that ``max_steps`` ended, which Lightning
        numbers as the next one, is the ended epoch's, in its order. ``forwarded``: the user's sampler was given
        that epoch already (by another wrapper around it, set up earlier for the same epoch), so it is not again."""
        dealt = epoch if dealt_as is None else dealt_as
        self.epoch = dealt
        if not forwarded:
            self._forward_epoch(dealt)
        self._epoch_set_ahead = (epoch, dealt)

    @property
    def head_digest(self) -> Optional[SequenceDigest]:
        """Digest of the current epoch's head (its first items, up to 64), available once the first item was
        yielded: the wrapper reads the whole head before it yields anything."""
        return self._head_digest

    @property
    def epoch_digest(self) -> Optional[SequenceDigest]:
        """Digest of the most recent epoch whose last items the wrapper dealt. It is taken when the final block
        is read, not when iteration ends: Lightning, knowing the length, never asks past the last batch."""
        return self._epoch_digest

    # ------------------------------------------------------------------ iteration
    def resume_within_epoch(self, epoch: int, done: Union[int, Callable[[], int], None]) -> None:
        """Make the next iteration, if it is of ``epoch``, skip this rank's first ``done`` items.

        For a restart from a mid-epoch checkpoint: those items were trained before it was written. The user's
        sampler is still iterated whole (the sequence, and so every rank's share, stays the same); only the
        yield of the first ``done`` items is skipped. ``len()`` is unchanged. The epoch is compared when the
        iteration reads its first item, not when the iterator is made: a loop may make the iterator, then
        finish the epoch without it (the checkpoint was at its end) and call ``set_epoch`` for the next. The
        first iteration that reads anything uses the skip up, whatever its epoch. ``done`` may be a callable
        returning the count, for a count that is known only when the iteration starts; it is called then, and
        only if the epoch matches. ``done=None`` drops a pending skip.
        """
        if done is None:
            self._resume = None
            return
        if not callable(done):
            done = self._check_resume_count(done)
        self._resume = (epoch, done)

    def _check_resume_count(self, done: Any) -> int:
        """``done`` as an int (a numpy or torch integer too), or an error saying what it must be."""
        count = integer_or_none(done)
        if count is None:
            raise TypeError(
                f"done must be an int (the number of items this rank yielded before the checkpoint), got {done!r}"
                f" ({type(done).__name__})."
            )
        if not 0 <= count <= len(self):
            raise ValueError(f"done must be in [0, {len(self)}] (this rank's items per epoch), got {count}.")
        return count

    def __iter__(self) -> Iterator[T]:
        # The work is done per block by generators that yield lists; chain.from_iterable walks each list in C,
        # so an item costs no Python frame at all (the floor is the user's sampler, at about 1 us a batch).
        items = chain.from_iterable(self._own_blocks())
        if self._resume is None:
            return items
        return self._resumed(items)

    def _resumed(self, items: Iterator[T]) -> Iterator[T]:
        """``items`` less the first ones a pending :meth:`resume_within_epoch` skips, if it is for this epoch."""
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] == self.epoch:
            done = resume[1]
            if callable(done):
                done = self._check_resume_count(done())
            items = islice(items, done, None)
        yield from items

    def _own_blocks(self) -> Iterator[Iterable[T]]:
        """This rank's items of the epoch, as consecutive lists."""
        length = self._declared_length()
        total = self._plan(length)
        share = (self.rank, self.num_replicas)
        digest = RunningDigest(self._source_name, self.epoch, length, self._batched, self._dealing_options(), share)
        self._head_digest = None
        self.yielded = []
        generator = torch.Generator().manual_seed(self.seed + self.epoch) if self.shuffle else None
        blocks: Iterator[Iterable[T]]
        if generator is None:
            blocks = self._unshuffled_blocks(length, total, digest)
        elif self.shuffle_window is None:
            blocks = self._full_shuffle_blocks(length, total, digest, generator)
        else:
            window = self.num_replicas * self.shuffle_window
            blocks = self._window_blocks(length, total, window, digest, generator)
        for block in blocks:
            if self.record_yielded:
                recorded: List[T] = []  # blocks may be one-shot iterators: keep what they yield
                try:
                    recorded.extend(block)  # a C dealer's error comes after its complete rounds or windows:
                except Exception:  # yield those first, as unrecorded iteration would
                    self.yielded.extend(recorded)
                    yield recorded
                    raise
                self.yielded.extend(recorded)
                block = recorded
            yield block
            del block  # consumed: free it (and what it refers to) before the next block is made

    def _warn_if_refilled(self, head: List[Any]) -> None:
        """Warn when two consecutive batches of the epoch's ``head`` are one and the same mutable object.

        The wrappers hold batches before yielding them (a round, a window, the head), so a batch sampler that
        refills one list in place would have later contents dealt in place of earlier batches; such a sampler
        yields the same object from its first batch on, so the head is where it shows. Only a warning: repeating
        an unchanged batch by reference is correct."""
        if not self._batched:
            return
        for position, (before, item) in enumerate(zip(head, head[1:]), start=1):
            if item is before and type(item) is not tuple:
                warnings.warn(
                    f"{self._source_name} yielded the very same {type(item).__name__} object as batches"
                    f" {position - 1} and {position} of epoch {self.epoch}. {type(self).__name__} reads ahead of"
                    " what it yields (a round of ranks, a shuffle window, the epoch's first batches), so a batch"
                    " sampler that refills one list in place has its later contents dealt in place of earlier"
                    " batches: yield a new list (or a tuple) for every batch. A batch repeated unchanged is dealt"
                    " correctly; yield a copy of it to silence this warning.",
                    UserWarning,
                    stacklevel=2,
                )
                return

    def _mismatch(self, length: int, produced: int, more: bool = False) -> LengthMismatchError:
        """The error for a sampler whose iteration made ``produced`` items (more than that if ``more``)."""
        return LengthMismatchError(
            f"{self._source_name}.__len__() returned {length} but iterating it produced"
            f" {'more than ' if more else ''}{produced} item(s) in"
            f" epoch {self.epoch}. Ranks step in lock-step on len(), so a wrong __len__ makes DDP hang or drop data:"
            f" make __len__ return exactly the number of items __iter__ yields for the current epoch."
        )

    def _check_exhausted(self, items: Iterator[Any], read: int, length: int) -> None:
        """Drain ``items``, of which ``read`` were read already, and raise unless the sampler made ``length``.

        At most ``length`` more items are read: a sampler that never ends must fail, not hang its rank."""
        extra = sum(1 for _ in islice(items, length + 1))
        if read + extra != length:
            raise self._mismatch(length, min(read + extra, read + length), more=extra > length)

    def _read_block(
        self,
        items: Iterator[Any],
        start: int,
        mask: bytes,
        kept: int,
        head: int,
        tail_start: int,
        length: int,
        digest: RunningDigest,
    ) -> List[Any]:
        """Read ``len(mask)`` items (positions ``start`` on) and return those ``mask`` keeps, ``kept`` of them.

        ``compress`` keeps them in C and steps its selectors once per item read, so if the sampler runs out
        inside the block, what is left of the selectors says how many it made. The first ``head`` kept items
        are the epoch's head, hashed in full, as are the items of the epoch's last round (positions
        ``tail_start`` on); the block's last position is always kept, on every rank, and is the digest's sample
        of the block.
        """
        selectors = iter(mask)
        picked = list(compress(islice(items, len(mask)), selectors))
        if len(picked) != kept:
            raise self._mismatch(length, start + len(mask) - length_hint(selectors))
        _hash_block(digest, picked, start, len(mask), head, tail_start)
        return picked

    def _unshuffled_blocks(self, length: int, total: int, digest: RunningDigest) -> Iterator[Iterable[T]]:
        """Deal the sequence round by round without shuffling: rank r keeps item r of every round of W.

        Three stages: the first rounds in Python, read whole before the first item is yielded (they feed the
        digest's head, which the first check compares, and the padding), the middle
        rounds in C (this rank's item of each complete round, the other ranks' items freed at once: the C
        helper's ``WindowDealer`` with windows of one round, in one go, or ``zip`` + ``itemgetter`` a chunk at a
        time without it), hashing the last item of every chunk of ``_CHUNK_ROUNDS`` rounds for the digest, and
        the last round in Python (length check, padding). Only complete rounds yield, so every rank yields the
        same number of items even when the sampler runs out early.
        """
        world, rank = self.num_replicas, self.rank
        items = iter(self.source)
        final_start = last_round_start(total, world)
        head_end = min(final_start, -(-_HEAD_ITEMS // world) * world)
        head: List[Any] = []
        if head_end:  # read whole before its first item is yielded: the first check compares all of it
            head = list(islice(items, head_end))
            if len(head) < head_end:
                raise self._mismatch(length, len(head))
            digest.update(head, 0)  # refuses what is not a batch of indices, before the warning below
            self._warn_if_refilled(head)
            self._head_digest = digest.snapshot()
            yield head[rank::world]
        compact = _store._compact
        if compact is not None and head_end < final_start:  # windows of one round, unpermuted
            first_round, end_round = head_end // world, final_start // world
            chunk_ends = [*range(first_round + _CHUNK_ROUNDS, end_round, _CHUNK_ROUNDS), end_round]
            yield from self._deal_windows(
                compact, items, None, first_round, end_round, world, chunk_ends, length, digest
            )
        full_chunk = _CHUNK_ROUNDS * world
        position = final_start if compact is not None else head_end
        while position < final_start:  # without the helper: a chunk at a time
            size = min(full_chunk, final_start - position)
            selectors = iter(b"\x01" * (size - world))  # compress keeps every item, counting them
            yield map(itemgetter(rank), zip(*[compress(islice(items, size - world), selectors)] * world))
            last = list(islice(items, world))
            read = size - world - length_hint(selectors) + len(last)
            if read < size:
                raise self._mismatch(length, position + read)
            digest.include(last[-1:], position + size - 1)  # the chunk's last item is the digest's sample
            yield (last[rank],)
            position += size
        final = list(islice(items, max(0, length - final_start)))
        self._check_exhausted(items, final_start + len(final), length)
        digest.include(final, final_start)  # the last round whole (a few items), as the shuffled paths hash theirs
        source_of_padding = head or final
        last_round = final[: total - final_start] + [
            source_of_padding[(p - length) % len(source_of_padding)] for p in range(max(length, final_start), total)
        ]
        if not head_end:
            self._head_digest = digest.snapshot()
        self._epoch_digest = digest.snapshot()
        yield last_round[rank::world]

    def _window_blocks(
        self,
        length: int,
        total: int,
        window: int,
        digest: RunningDigest,
        generator: torch.Generator,
    ) -> Iterator[Iterable[T]]:
        """Permute consecutive windows of the sequence and keep this rank's items of each, streaming.

        A window's permutation is known before the window is read (see ``_windows.window_permutations``), so
        the rank knows which of its positions it takes and frees the other ranks' items at once. Windows are
        read in blocks of about ``_WINDOW_BLOCK_ITEMS`` own items. The last position of every few blocks (about
        one in ``_SAMPLE_SPACING`` positions, see ``_windows.sampled_block_ends``) is the digest's sample, which
        every rank hashes. The first ``_HEAD_ITEMS`` positions are kept everywhere too: the digest hashes them in
        full, and padding repeats them. The tail that ``pad=False`` cuts joins the last window (see
        ``_windows.last_window``).

        A window yields only once it was read whole (a block in the head or at the end only once the whole
        block was), so all ranks yield the same number of items even when the sampler runs out early or
        fails. The C helper's ``WindowDealer`` draws, reads and yields the other blocks a window at a
        time, so a rank holds one window's items, which stay in the core's caches. Without it the blocks are
        planned in numpy and ``itertools.compress`` keeps a block's items in C; the block yields once read
        whole, or its complete windows if the sampler stopped inside it: the same items on both paths.
        """
        items = iter(self.source)
        world, rank = self.num_replicas, self.rank
        pad_count = total - length
        head_end = max(_HEAD_ITEMS, pad_count)  # leading positions every rank keeps: digest head, padding
        tail_start = last_round_start(total, world)  # every rank keeps the last round and hashes it whole
        head: List[Any] = []
        per_window = window // world
        windows_per_block = max(1, _WINDOW_BLOCK_ITEMS // per_window)
        blocks_per_sample = max(1, _SAMPLE_SPACING // (windows_per_block * window))
        seed = int(torch.randint(2**63 - 1, (), generator=generator))
        compact = _store._compact
        windows = -(-total // window)
        head_windows = -(-head_end // window)
        for first, end in plan_ranges(windows, window, head_windows):
            if compact is not None and first >= head_windows and end < windows:  # neither head nor last window
                samples = sampled_block_ends(first, end, windows_per_block, blocks_per_sample)
                yield from self._deal_windows(compact, items, seed, first, end, window, samples, length, digest)
                continue
            plan = window_plan(
                PlanSpan(
                    seed, first, end, window, total, length, windows_per_block, blocks_per_sample, head_end, world, rank
                )
            )
            for block in plan.blocks:
                mask = plan.mask[block.mask_start : block.mask_end]
                positions = plan.order[block.order_start : block.order_end].tolist()
                if block.head or block.last:
                    picked = self._read_block(
                        items, block.start, mask, block.kept, block.head, tail_start, length, digest
                    )
                    head.extend(picked[: block.head])
                    if block.start == 0:
                        self._warn_if_refilled(head)
                        self._head_digest = digest.snapshot()
                    if block.last:
                        self._check_exhausted(items, block.start + len(mask), length)
                        digest.update((), length)
                        self._epoch_digest = digest.snapshot()
                        picked.extend(head[:pad_count])
                else:
                    selectors = iter(mask)
                    picked = []
                    failure: Optional[Exception] = None
                    try:
                        picked.extend(compress(islice(items, len(mask)), selectors))  # keeps what it read
                    except Exception as error:  # the sampler's: raised after the complete windows, as in C
                        failure = error
                    read = len(mask) - length_hint(selectors)
                    if failure is not None or read < len(mask):
                        positions = positions[: read // window * per_window]  # the complete windows' items
                        if positions:
                            yield [picked[position] for position in positions]
                        raise failure or self._mismatch(length, block.start + read)
                    if block.sampled:
                        try:
                            _hash_block(digest, picked, block.start, len(mask), 0, tail_start)
                        except Exception:  # its sample, the last item, is bad: as in C, which hashes it as
                            positions = positions[: (len(mask) // window - 1) * per_window]  # it reads it, the
                            if positions:  # windows before the last one were complete and are yielded
                                yield [picked[position] for position in positions]
                            raise
                if len(positions) > 1:
                    yield itemgetter(*positions)(picked)
                elif positions:
                    yield (picked[positions[0]],)
            del plan  # before the next plan is drawn: two plans' arrays never coexist

    def _deal_windows(
        self,
        compact: Any,
        items: Iterator[Any],
        seed: Optional[int],
        first: int,
        end: int,
        window: int,
        sampled_ends: List[int],
        length: int,
        digest: RunningDigest,
    ) -> Iterator[Iterable[T]]:
        """Deal windows ``first`` to ``end - 1``, whole blocks of them, through the C helper's ``WindowDealer``,
        which hashes the last item of each sampled block (those ending before the windows ``sampled_ends``) as
        it reads it, as the Python path does after reading the block. ``seed`` None deals without permuting."""
        sample = digest.include_as_read([sampled_end * window - 1 for sampled_end in sampled_ends])
        world, rank = self.num_replicas, self.rank
        sampled_windows = np.array(sampled_ends, dtype=np.int64) - 1
        dealer = compact.WindowDealer(items, seed, window, world, rank, first, end, sampled_windows, sample)
        yield dealer
        if dealer.read < (end - first) * window:
            raise self._mismatch(length, first * window + dealer.read)

    def _full_shuffle_blocks(
        self, length: int, total: int, digest: RunningDigest, generator: torch.Generator
    ) -> Iterator[Iterable[T]]:
        """Shuffle the whole epoch: read it all, keeping only this rank's share, compactly.

        The permutation depends only on ``seed + epoch`` and the length, so a rank knows before reading which
        positions it needs. The store reads the sampler's stream in blocks of ``_READ_BLOCK`` positions,
        storing this rank's items and returning the digest's head and each block's last item (every rank
        hashes those), and drops every other item as soon as it is read.
        """
        world, rank = self.num_replicas, self.rank
        # pad=False (total < length) deals the first `total` positions of a permutation of the whole sequence,
        # so the items it drops are drawn anew each epoch, as with DistributedSampler(shuffle=True, drop_last=True).
        # A copy of this rank's positions: a view would keep the whole permutation alive for the epoch.
        own_positions = _serial_randperm(max(total, length), generator)[:total][rank::world].numpy().copy()
        # Padding positions repeat the start of the sequence.
        own_sources = np.where(own_positions < length, own_positions, (own_positions - length) % length)
        # The store holds each needed source once, in reading order: a source's slot is its rank among them.
        actions = np.zeros(length, dtype=np.uint8)
        actions[own_sources] = STORE
        stored = np.cumsum(actions, dtype=np.int64)
        slot_of_position = (stored - 1)[own_sources]
        block_starts = np.arange(0, length, _READ_BLOCK)
        block_ends = np.minimum(block_starts + _READ_BLOCK, length)
        actions[:_HEAD_ITEMS] |= KEEP  # the digest's head,
        actions[block_ends - 1] |= KEEP  # its sample: each block's last item, and
        tail_start = last_round_start(total, world)
        actions[tail_start:] |= KEEP  # the last round, hashed whole
        action_bytes = actions.tobytes()
        items = iter(self.source)
        store = CompactStore(batched=self._batched, owner=self._source_name, expected=int(stored[-1]))
        del stored
        for start, end in zip(block_starts.tolist(), block_ends.tolist()):
            kept, count = store.read(items, action_bytes[start:end])
            if count < end - start:
                raise self._mismatch(length, start + count)
            _hash_block(digest, kept, start, end - start, max(0, min(end, _HEAD_ITEMS) - start), tail_start)
            if start == 0:
                self._warn_if_refilled(kept[: min(end, _HEAD_ITEMS)])
        self._check_exhausted(items, length, length)
        digest.update((), length)
        self._head_digest = self._epoch_digest = digest.snapshot()
        yield from store.blocks_in_order(slot_of_position)  # type: ignore[misc]


def _serial_randperm(size: int, generator: torch.Generator) -> torch.Tensor:
    """``torch.randperm(size, generator=generator)``, drawn on this thread alone.

    torch fills the array in a parallel region before shuffling it; the pool's threads then spin idle for a
    while, which costs the rank about a tenth of a cheap sampler's epoch in CPU time at 1e5 batches, for a fill
    that takes 0.3 ms on one thread. The permutation is the same with any number of threads.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        return torch.randperm(size, generator=generator)
    torch.set_num_threads(1)
    try:
        return torch.randperm(size, generator=generator)
    finally:
        torch.set_num_threads(threads)


def _hash_block(digest: RunningDigest, kept: List[Any], start: int, size: int, head: int, tail_start: int) -> None:
    """Hash what every rank kept of the block of ``size`` positions from ``start``: its first ``head`` items
    (the epoch's head, in full) and, past the head, its items from position ``tail_start`` on (the epoch's last
    round, in full, as the unshuffled deal hashes it) or else its last item (the block's sample)."""
    if head:
        digest.update(kept[:head], start)
    end = start + size
    tail = min(max(1, end - max(tail_start, start)), size - head)
    if tail > 0:
        digest.include(kept[-tail:], end - tail)


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
        seed: base seed of that permutation, an integer in ``[-2**63, 2**63 - 1]``. Seeds that differ by a
            multiple of ``2**32`` shuffle alike: torch's CPU generator keeps the low 32 bits (as for
            ``DistributedSampler``).
        pad: True repeats batches from the start of the epoch's sequence so every rank gets
            ``ceil(len / W)`` batches; False drops the incomplete last round (``len // W`` each). When
            shuffling, the ``len % W`` batches dropped are drawn by the shuffle, anew each epoch: from the whole
            epoch, or with ``shuffle_window`` from the last window, which the cut tail joins. Padding comes
            before the shuffle: the repeats are the sequence's first batches, dealt wherever the shuffle puts
            them (torch's ``DistributedSampler`` repeats the first of the shuffled order instead).
        shuffle_window: with ``shuffle=True``, permute within consecutive windows of ``shuffle_window * W``
            batches and stream, holding this rank's ``shuffle_window`` batches of a window as the sampler made
            them; None shuffles the whole epoch, which must then be read before the first batch and is stored
            compactly (use it rather than a window as long as the epoch, which would hold the whole share).
            The whole-epoch shuffle hands each batch back as a new list of ints (the same indices; a tuple,
            array or tensor batch becomes a list); the other modes yield the sampler's own objects, so the
            sampler must yield a new sequence per batch, not refill and re-yield one.
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

    def __copy__(self) -> "DistributedBatchSamplerWrapper":
        # A shallow copy must get a relay of its own: the original's would set the original's epoch.
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.sampler = _EpochRelay(clone)
        return clone

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

    Every other attribute is read and set on the user's batch sampler's own ``sampler``, as on one device (a
    hard-negative callback setting ``batch_sampler.sampler.weights``): set on the relay, it would change
    nothing, silently. A batch sampler without one gets an AttributeError that says so.
    """

    __slots__ = ("_wrapper", "__weakref__")

    def __init__(self, wrapper: DistributedBatchSamplerWrapper) -> None:
        object.__setattr__(self, "_wrapper", wrapper)

    def set_epoch(self, epoch: int) -> None:
        self._wrapper.set_epoch(epoch)

    def __reduce__(self) -> Any:  # every pickle protocol: a class with __slots__ needs protocol 2 by default
        return (_EpochRelay, (self._wrapper,))

    def _users_sampler(self, name: str) -> Any:
        source = self._wrapper.source
        try:
            return source.sampler  # type: ignore[attr-defined]
        except AttributeError:
            raise AttributeError(
                f"{type(self._wrapper).__name__}.sampler only relays set_epoch to the wrapper: your"
                f" {self._wrapper._source_name} has no sampler attribute, so there is no {name!r} to reach through"
                " it. Reach your batch sampler's attributes through loader.batch_sampler (or"
                " loader.batch_sampler.batch_sampler, the object itself)."
            ) from None

    def _replace_users_sampler(self, sampler: Any) -> None:
        """Set the user's batch sampler's own ``sampler`` (``wrapper.sampler = s``); the relay stays."""
        self._users_sampler("sampler")  # the error for a batch sampler without one
        setattr(self._wrapper.source, "sampler", sampler)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # private names, and copy's and pickle's protocols, stay the relay's
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._users_sampler(name), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._users_sampler(name), name, value)

    def __repr__(self) -> str:
        return f"_EpochRelay(to={type(self._wrapper).__name__} over {self._wrapper._source_name})"

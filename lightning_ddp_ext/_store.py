"""Compact storage for the share of an epoch a rank holds when it shuffles the whole epoch.

Python lists of Python ints cost about 40 bytes per index and give the garbage collector millions of
objects to walk; here the indices live in one flat array plus offsets, and are turned back into lists only
when yielded. The array holds int32 (4 bytes per index) while every index fits, which is every dataset of
fewer than 2**31 samples, and is widened to int64 once one does not: half the memory, and half the pages
the kernel must zero on first touch (at 1e6 batches of 64 that alone is a tenth of a user sampler's epoch).

Converting is most of what storing costs: ``array.fromlist`` and ``memoryview.tolist`` take longer per index
than a cheap user sampler takes to make it, and holding a block of the sampler's lists until they are
converted pushes its allocations out of the caches. The optional C helper ``_compact`` (built by setup.py
where a compiler is found) has its own store, ``_compact.Store``: it reads the sampler's stream itself, packs
each item straight into its array as it arrives and releases it, and rebuilds batches with plain int
allocations. It takes only exact ints and exact lists or tuples of them; it hands anything else to the same
converter as the pure-Python path, so both paths store the same indices and raise the same errors.
"""
from __future__ import annotations

import hashlib
import operator
import sys
import warnings
from array import array
from itertools import accumulate, chain, compress, islice
from operator import length_hint
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np


def source_digest(source: Path) -> str:
    """SHA-256 of the C helper's source, line endings as LF: what setup.py records in the module it builds."""
    return hashlib.sha256(source.read_bytes().replace(b"\r\n", b"\n")).hexdigest()


def _load_helper() -> Optional[ModuleType]:
    """The C helper, or None where it is not built or was built from other sources than the ones beside it.

    An editable install keeps the module built in place; pulling newer sources without rebuilding would call
    an old helper with new arguments (or miss a function). Such a helper is set aside, with a warning that says
    how to rebuild: the pure-Python path computes the same, slower."""
    try:
        from lightning_ddp_ext import _compact as helper
    except ImportError:  # not built (no compiler at install time): the pure-Python path does the same, slower
        return None
    source = Path(__file__).with_name("_compact.c")
    if source.is_file() and getattr(helper, "SOURCE_DIGEST", None) != source_digest(source):
        warnings.warn(
            f"lightning_ddp_ext's C helper {helper.__file__} was built from other sources than {source}, so it is"
            " not used (the samplers run on their slower pure-Python path). Rebuild it: `pip install -e .` in"
            " an editable checkout, or reinstall lightning_ddp_ext.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return helper


_compact = _load_helper()

# Before Python 3.10 array.fromlist took any object with __int__ (a Decimal, a numpy float) and truncated it.
_FROMLIST_TRUNCATES = sys.version_info < (3, 10)
# Batches the C helper rebuilds per call: enough to amortise the call, few enough to stay in the caches.
_REBUILD_BLOCK = 64
# CompactStore.read's action bytes: bit 1 stores the item, bit 2 returns it. The tables pick one bit.
STORE, KEEP = 1, 2
_STORE_BIT = bytes(action & STORE for action in range(256))
_KEEP_BIT = bytes((action & KEEP) >> 1 for action in range(256))


class CompactStore:
    """Append-only store of index batches (or single indices), read back by insertion number.

    Args:
        batched: True when every item is a sequence of indices, False when items are single indices.
        owner: name of the sampler the items come from, for error messages.
        expected: how many items will be stored, if known: the C store sizes its array from it.
    """

    def __init__(self, batched: bool, owner: str, expected: int = 0) -> None:
        self._batched = batched
        self._convert = _converter(batched, owner)
        # With the helper the C store holds everything; expected (how many items will be stored) sizes it.
        self._native = _compact.Store(batched, self._convert, expected) if _compact is not None else None
        self._flat = array("i")  # int32 until an index needs more (see _widen); pure-Python path only
        self._offsets = array("q", [0])

    def __len__(self) -> int:
        if self._native is not None:
            return len(self._native)
        return len(self._offsets) - 1 if self._batched else len(self._flat)

    @property
    def itemsize(self) -> int:
        """Bytes per stored index: 4 while every index fits in int32, 8 after."""
        return self._native.itemsize if self._native is not None else self._flat.itemsize

    def read(self, items: Iterator[Any], actions: bytes) -> Tuple[List[Any], int]:
        """Take up to ``len(actions)`` items from ``items`` and act on item ``i`` as ``actions[i]`` says:
        ``STORE`` appends it to the store, ``KEEP`` returns it (both, or neither: it is dropped at once).

        Returns the kept items and how many items were taken (fewer than ``len(actions)`` only when
        ``items`` ran out).
        """
        if self._native is not None:
            return self._native.read(items, actions)
        selectors = iter(actions)
        picked: List[Any] = []
        failure: Optional[Exception] = None
        try:
            picked.extend(compress(islice(items, len(actions)), selectors))  # steps `selectors` once per item
        except Exception as error:  # the sampler's own: raised once what it made before is stored, as the C
            failure = error  # store stores each item as it reads it (a bad one among them is named first)
        count = len(actions) - length_hint(selectors)
        picked_actions = actions[:count].replace(b"\0", b"")  # one action per picked item
        self._extend(compress(picked, picked_actions.translate(_STORE_BIT)))
        if failure is not None:
            raise failure
        return list(compress(picked, picked_actions.translate(_KEEP_BIT))), count

    def _extend(self, items: Iterable[Any]) -> None:
        """Append many items, converted in C by ``array.fromlist`` (no Python step per item)."""
        items = list(items)
        try:
            if not self._batched:
                if _has_bool(items):
                    raise TypeError  # array would store True as 1: named below
                self._append_values(items)
                return
            if any(isinstance(item, (str, bytes)) for item in items):
                raise TypeError  # they iterate as characters or small ints, but are no index batches
            for _ in map(len, items):  # without len(): converted one by one below, where an iterator is refused
                pass
            # Lengths from what iteration gives: only an exact list or tuple's len() is sure to agree with it.
            parts = [item if type(item) in (list, tuple) else _elements(item) for item in items]
            lengths = list(map(len, parts))
            values = list(chain.from_iterable(parts))
            if _has_bool(values):
                raise TypeError
            self._append_values(values)
        except (TypeError, ValueError, OverflowError):
            for item in items:  # one at a time, to name the item that is not an index (_convert raises)
                self._append_values(array("q", self._convert(item)).tolist())
                if self._batched:
                    self._offsets.append(len(self._flat))
            return
        self._append_offsets(lengths)

    def _append_values(self, values: List[Any]) -> None:
        """Append indices, converted in C by ``array.fromlist`` (all or nothing: on error nothing is added)."""
        if _FROMLIST_TRUNCATES and any(type(value) is not int for value in values):
            raise TypeError  # for _extend to convert one by one, refusing what has no __index__
        try:
            self._flat.fromlist(values)
        except OverflowError:
            if self._flat.itemsize == 8:
                raise
            self._widen()  # an index past int32: retry wide (past int64 raises again, for _extend to name)
            self._flat.fromlist(values)

    def _widen(self) -> None:
        """Hold the indices as int64 from now on (an index does not fit in int32)."""
        self._flat = array("q", self._flat)

    def _append_offsets(self, lengths: Iterable[int]) -> None:
        """Record the ends of batches of ``lengths`` indices, appended to the flat array in that order."""
        self._offsets.extend(islice(accumulate(lengths, initial=self._offsets[-1]), 1, None))

    def blocks_in_order(self, order: np.ndarray[Any, Any], block_size: int = 1024) -> Iterator[Iterable[Any]]:
        """The items at insertion numbers ``order``, a block at a time: each batch is rebuilt as a list of ints
        only when its block is reached, so the rebuilt lists never pile up."""
        if self._native is not None:
            slots = np.ascontiguousarray(order, dtype=np.int64)
            step = _REBUILD_BLOCK if self._batched else block_size
            for start in range(0, len(slots), step):
                yield self._native.lists(slots[start : start + step])
            return
        flat = self._flat
        if not self._batched:
            values = np.frombuffer(flat, dtype=flat.typecode)
            for start in range(0, len(order), block_size):
                yield values[order[start : start + block_size]].tolist()
            return
        offsets = np.frombuffer(self._offsets, dtype=np.int64)
        view = memoryview(flat)
        for start in range(0, len(order), block_size):
            slots = order[start : start + block_size]
            slices = map(slice, offsets[slots].tolist(), offsets[slots + 1].tolist())
            yield map(memoryview.tolist, map(view.__getitem__, slices))


def _bool_dtype(value: Any) -> Optional[bool]:
    """Whether ``value``'s numpy or torch dtype is bool; None when it has no dtype that tells (none, an object
    array, one that cannot be read)."""
    try:
        dtype = value.dtype
    except Exception:
        return None
    if isinstance(dtype, np.dtype):
        return None if dtype.kind == "O" else dtype.kind == "b"
    torch = sys.modules.get("torch")  # no tensor exists unless torch was imported
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtype is torch.bool
    return None


_TORCH_INTEGER_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")


def _elements(batch: Any) -> List[Any]:
    """What iterating ``batch`` gives, as a list: from ``tolist()`` for a 1-d numpy array or (dense) tensor of
    integers, exactly those types (Python ints, made in C, where iterating gives a numpy scalar or a 0-d tensor
    per element); any other batch, floats and dates included, is iterated, for ``operator.index`` to judge."""
    kind = type(batch)
    if kind is np.ndarray:
        if batch.ndim == 1 and batch.dtype.kind in "iu":
            return batch.tolist()  # type: ignore[no-any-return]
    else:
        torch = sys.modules.get("torch")  # no tensor exists unless torch was imported
        if (
            torch is not None
            and kind is torch.Tensor
            and batch.ndim == 1
            and batch.layout is torch.strided
            and not batch.is_meta
            and any(batch.dtype is getattr(torch, name, None) for name in _TORCH_INTEGER_DTYPES)
        ):
            return batch.tolist()  # type: ignore[no-any-return]
    return list(batch)


def is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool, or a numpy or torch bool (scalar, array or tensor): ``operator.index`` turns
    ``torch.tensor(True)`` into 1, while indexing with it is masking. Told by type for ints and numpy integers."""
    kind = type(value)
    if kind is bool or kind is np.bool_:
        return True
    if issubclass(kind, (int, np.integer)):
        return False
    return _bool_dtype(value) is True


def _has_bool(values: List[Any]) -> bool:
    """Whether any of ``values`` is a bool (see :func:`is_bool`); lists of exact ints or of numpy integers are
    told by their types alone, at C speed."""
    kinds = set(map(type, values))
    kinds.discard(int)
    if not kinds:
        return False
    if bool in kinds or np.bool_ in kinds:
        return True
    unsure = {kind for kind in kinds if not issubclass(kind, (int, np.integer))}
    return bool(unsure) and any(is_bool(value) for value in values if type(value) in unsure)


class NotIndicesError(TypeError):
    """An item that reading would spoil or change: its message says why, for the caller's error to quote."""


def indices_of(item: Any, batched: bool) -> Any:
    """The indices of one item as the wrappers read them: a tuple of ints for a batch, an int otherwise.

    ``operator.index``, not ``int()``: a float or a string is refused, never truncated or parsed. Refused with
    :class:`NotIndicesError` too: an iterator (reading it to hash or store it would hand the DataLoader an empty
    batch) and a bool (``True`` would be stored as index 1, while ``tensor[True]`` is not ``tensor[1]``).
    Anything else that is no index raises the TypeError of ``operator.index``.
    """
    if not batched:
        if is_bool(item):
            raise NotIndicesError("A bool is not an index: yield ints.")
        return operator.index(item)
    if isinstance(item, (str, bytes)):
        raise TypeError("a string is no batch")  # it iterates as characters or small ints
    if isinstance(item, Iterator):
        raise NotIndicesError(
            "It is an iterator, which would be used up by reading it (the DataLoader would get an empty batch):"
            " yield a list or a tuple of indices."
        )
    holds_bools = _bool_dtype(item)  # an array or tensor tells for all its elements at once
    if holds_bools and isinstance(getattr(item, "ndim", None), int) and item.ndim > 0:
        raise NotIndicesError("A bool mask is not a batch of indices: yield the positions where it is True.")
    values = tuple(_elements(item))
    if holds_bools is None and _has_bool(list(values)):  # before operator.index, which turns True into 1
        raise NotIndicesError("A bool is not an index: yield ints.")
    return tuple(map(operator.index, values))


def _converter(batched: bool, owner: str) -> Callable[[Any], bytes]:
    """The general, slow conversion of one item to its indices as int64 bytes, raising a TypeError that names
    the item and the sampler (``owner``). A closure, not a method: the C store holds it, and a method would
    tie the two in a reference cycle."""
    expected = "a sequence of integer indices" if batched else "an integer index"

    def convert(item: Any) -> bytes:
        try:
            indices = indices_of(item, batched)
            return array("q", indices if batched else [indices]).tobytes()
        except OverflowError:
            raise TypeError(
                f"{owner} yielded {item!r}; each item must be {expected}, and an index must fit in 64 bits"
                " (-2**63 <= index < 2**63) to be stored for the whole-epoch shuffle."
            ) from None
        except (TypeError, ValueError) as error:
            reason = f" {error}" if isinstance(error, NotIndicesError) else ""
            raise TypeError(f"{owner} yielded {item!r}; each item must be {expected}.{reason}") from None

    return convert

"""Compact storage for the share of an epoch a rank holds when it shuffles the whole epoch.

Python lists of Python ints cost about 40 bytes per index and give the garbage collector millions of
objects to walk; here the indices live in one flat ``array('q')`` plus offsets (8 bytes per index), and are
turned back into lists only when yielded.
"""
from __future__ import annotations

import operator
from array import array
from itertools import accumulate, chain, islice
from typing import Any, Iterable, Iterator

import numpy as np


class CompactStore:
    """Append-only store of index batches (or single indices), read back by insertion number.

    Args:
        batched: True when every item is a sequence of indices, False when items are single indices.
        owner: name of the sampler the items come from, for error messages.
    """

    def __init__(self, batched: bool, owner: str) -> None:
        self._batched = batched
        self._owner = owner
        self._flat = array("q")
        self._offsets = array("q", [0])

    def __len__(self) -> int:
        return len(self._offsets) - 1 if self._batched else len(self._flat)

    def append(self, item: Any) -> None:
        try:
            if not self._batched:
                self._flat.append(item)
            elif type(item) is list:
                self._flat.fromlist(item)  # the common case, and the fastest conversion
                self._offsets.append(len(self._flat))
            else:  # operator.index, not int(): a float or a string is refused, never truncated or parsed
                self._flat.extend(map(operator.index, item))
                self._offsets.append(len(self._flat))
        except (TypeError, ValueError, OverflowError):
            expected = "a sequence of integer indices" if self._batched else "an integer index"
            raise TypeError(f"{self._owner} yielded {item!r}; each item must be {expected}.") from None

    def extend(self, items: Iterable[Any]) -> None:
        """Append many items; the conversion runs in C, with no Python step per item."""
        items = list(items)
        try:
            if not self._batched:
                self._flat.fromlist(items)  # all or nothing: on error the array is unchanged
                return
            lengths = list(map(len, items))
            self._flat.fromlist(list(chain.from_iterable(items)))
        except (TypeError, ValueError, OverflowError):
            for item in items:  # one at a time, to name the item that is not an index (append raises)
                self.append(item)
            return
        self._offsets.extend(islice(accumulate(lengths, initial=self._offsets[-1]), 1, None))

    def blocks_in_order(self, order: np.ndarray[Any, Any], block_size: int = 1024) -> Iterator[Iterable[Any]]:
        """The items at insertion numbers ``order``, ``block_size`` at a time, as lazy iterators: each batch is
        rebuilt as a list of ints only when the consumer asks for it, so the rebuilt lists never pile up."""
        flat = self._flat
        if not self._batched:
            for start in range(0, len(order), block_size):
                yield map(flat.__getitem__, order[start : start + block_size].tolist())
            return
        offsets = np.frombuffer(self._offsets, dtype=np.int64)
        view = memoryview(flat)
        for start in range(0, len(order), block_size):
            slots = order[start : start + block_size]
            slices = map(slice, offsets[slots].tolist(), offsets[slots + 1].tolist())
            yield map(memoryview.tolist, map(view.__getitem__, slices))

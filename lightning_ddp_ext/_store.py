"""Compact storage for the share of an epoch a rank holds when it shuffles the whole epoch.

Python lists of Python ints cost about 40 bytes per index and give the garbage collector millions of
objects to walk; here the indices live in one flat ``array('q')`` plus offsets (8 bytes per index), and are
turned back into lists only when yielded.
"""
from __future__ import annotations

import operator
from array import array
from typing import Any, Iterator, List, Sequence


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

    def blocks_in_order(self, order: Sequence[int], block_size: int = 1024) -> Iterator[List[Any]]:
        """The items at insertion numbers ``order``, in lists of ``block_size``: lists of ints for batches."""
        flat = self._flat
        if not self._batched:
            for start in range(0, len(order), block_size):
                yield list(map(flat.__getitem__, order[start : start + block_size]))
            return
        offsets = self._offsets.tolist()
        view = memoryview(flat)
        for start in range(0, len(order), block_size):
            yield [view[offsets[k] : offsets[k + 1]].tolist() for k in order[start : start + block_size]]

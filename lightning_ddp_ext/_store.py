"""Compact storage for the part of an epoch a rank must hold when it shuffles the whole epoch.

Python lists of Python ints cost about 40 bytes per index and give the garbage collector millions of
objects to walk; here the indices live in flat ``int64`` numpy arrays plus offsets, appended in chunks so
that the conversion runs in C, and are read back in chunks in the order the rank yields them.
"""
from __future__ import annotations

from itertools import chain
from typing import Iterator, List, Sequence

import numpy as np

_FLUSH_EVERY = 4096  # staged items converted to numpy at once
_READ_EVERY = 2048  # items converted back to Python lists at once


class CompactStore:
    """Append-only store of index batches (or single indices) addressed by insertion number.

    Args:
        batched: True when every item is a sequence of indices, False when items are single indices.
    """

    def __init__(self, batched: bool) -> None:
        self._batched = batched
        self._staged: List[object] = []
        self._flat_chunks: List[np.ndarray] = []
        self._length_chunks: List[np.ndarray] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size + len(self._staged)

    def append(self, item: object) -> None:
        self._staged.append(item)
        if len(self._staged) >= _FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        if self._batched:
            lengths = np.fromiter(map(len, staged), dtype=np.int64, count=len(staged))  # type: ignore[arg-type]
            flat = np.fromiter(chain.from_iterable(staged), dtype=np.int64, count=int(lengths.sum()))  # type: ignore[arg-type]
            self._length_chunks.append(lengths)
        else:
            flat = np.fromiter(staged, dtype=np.int64, count=len(staged))
        self._flat_chunks.append(flat)
        self._size += len(staged)

    def iter_in_order(self, order: Sequence[int]) -> Iterator[object]:
        """Yield the stored items at insertion numbers ``order``, as Python lists (or ints)."""
        self._flush()
        flat = np.concatenate(self._flat_chunks) if len(self._flat_chunks) > 1 else self._flat_chunks[0]
        self._flat_chunks = []
        order_array = np.asarray(order, dtype=np.int64)
        if not self._batched:
            for start in range(0, len(order_array), _READ_EVERY):
                yield from flat[order_array[start : start + _READ_EVERY]].tolist()
            return
        lengths = np.concatenate(self._length_chunks)
        self._length_chunks = []
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        for start in range(0, len(order_array), _READ_EVERY):
            picked = order_array[start : start + _READ_EVERY]
            picked_lengths = lengths[picked]
            bounds = np.zeros(len(picked) + 1, dtype=np.int64)
            np.cumsum(picked_lengths, out=bounds[1:])
            # Positions in `flat` of every index of the picked batches, in output order.
            gather = np.repeat(offsets[picked] - bounds[:-1], picked_lengths) + np.arange(bounds[-1])
            values = flat[gather].tolist()
            cuts = bounds.tolist()
            for i in range(len(picked)):
                yield values[cuts[i] : cuts[i + 1]]

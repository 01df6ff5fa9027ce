"""Planning the windowed shuffle: each window's permutation, and what a rank keeps and yields of it.

With ``shuffle=True, shuffle_window=K`` the wrappers permute consecutive windows of ``K * W`` positions. Each
window's permutation is drawn from counters (SplitMix64, then Fisher-Yates), so any window's can be computed on
its own, on every rank alike, before the window is read. A plan says, for a run of windows read in blocks,
which positions this rank keeps (its own, each block's last, the epoch's head) and in what order it yields
them. The C helper (``_compact``) draws the same permutations and deals the windows between the head and the
last window itself; these plans cover the rest, and all of it without the helper. Framework-free (numpy,
and the C helper when it is built).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Iterator, List, NamedTuple

import numpy as np

from lightning_ddp_ext import _store

# Ranges of windows planned (or dealt in C) in one go grow 8, 64, ... windows up to this many positions after
# the head (see plan_ranges): a short epoch needs few numpy calls, and a plan's arrays stay small.
_MAX_PERMUTATION_ELEMENTS = 1 << 16
_PLAN_GROWTH = 8
# Positions a plan may have to be made in plain Python rather than numpy (see window_plan): numpy's cost per
# call (tens of calls per plan) outweighs Python's per position below about this many.
_PYTHON_PLAN_POSITIONS = 256


class WindowBlock(NamedTuple):
    """One block of whole windows, as ``_DealingWrapper._window_blocks`` reads it."""

    start: int  # first position of the block in the (padded) sequence
    kept: int  # items ``compress`` keeps: this rank's, the block's last, and the head
    head: int  # leading items of the block that lie in the epoch's head (kept on every rank)
    mask_start: int  # the block's span in ``WindowPlan.mask``: the positions read from the sampler (those
    mask_end: int  # past its length are padding, never read)
    order_start: int  # the block's span in ``WindowPlan.order``
    order_end: int
    last: bool = False  # the epoch's last block
    sampled: bool = True  # a plain block whose last item the digest hashes (see sampled_block_ends)


def sampled_block_ends(first: int, end: int, windows_per_block: int, blocks_per_sample: int) -> List[int]:
    """Where the blocks end (one past their last window) whose last item the digest samples, among the blocks
    of ``windows_per_block`` windows from window ``first`` to ``end - 1``: every ``blocks_per_sample``-th
    block, and the last one. Head blocks and the epoch's last block are sampled whatever this says."""
    step = windows_per_block
    block_ends = [min(block_end, end) for block_end in range(first + step, end + step, step)]
    sampled = block_ends[blocks_per_sample - 1 :: blocks_per_sample]
    if not sampled or sampled[-1] != end:
        sampled.append(end)
    return sampled


class WindowPlan(NamedTuple):
    """Consecutive windows planned in one go, for the pure-Python path (and the head and last blocks)."""

    mask: bytes  # one byte per sampler position read in the plan: 1 where ``compress`` keeps the item
    order: np.ndarray[Any, Any]  # this rank's items in yield order, as indices into each block's kept items
    blocks: List[WindowBlock]


class PlanSpan(NamedTuple):
    """What a window plan covers: windows ``first`` to ``end - 1`` of ``window`` positions each, of an epoch of
    ``length`` items dealt as ``total`` positions (padded or cut to a multiple of ``world``), for ``rank``."""

    seed: int  # the epoch's permutation seed
    first: int
    end: int
    window: int
    total: int
    length: int
    windows_per_block: int  # windows read per block (see _DealingWrapper._window_blocks)
    blocks_per_sample: int  # blocks per digest sample (see sampled_block_ends)
    head_end: int  # positions before it are the head, kept on every rank
    world: int
    rank: int


def plan_ranges(windows: int, window: int, head_windows: int) -> Iterator[tuple[int, int]]:
    """Split ``windows`` windows into ranges planned (or dealt) in one go: the windows that hold the head (one
    block, read whole before the first batch, so that the first check compares the whole head; a small plan
    whatever the epoch's length), then 8, 64, ... windows up to ``_MAX_PERMUTATION_ELEMENTS`` positions (a
    short epoch needs few numpy calls, and a plan's arrays stay small), and the epoch's last window on its
    own. Every range between the head and the last window holds only whole windows that every rank reads
    alike: the C helper deals them. Blocks start at each range's first window."""
    first = min(head_windows, windows)
    if first:
        yield 0, first
    size = _PLAN_GROWTH
    while first < windows - 1:
        end = min(windows - 1, first + size)
        yield first, end
        first = end
        size = min(size * _PLAN_GROWTH, max(1, _MAX_PERMUTATION_ELEMENTS // window))
    if first < windows:
        yield first, windows


# Windows permuted together: below this many, a Python loop over each window's swaps is cheaper than a numpy
# step per column (each step costs microseconds, a Python swap about 0.1 us).
_VECTOR_ROWS = 64
_MIX_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_MIX_INCREMENT = 0x9E3779B97F4A7C15


def splitmix64(counters: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """SplitMix64's output for each uint64 counter: a bijective, nonlinear mix, modulo 2**64 (as the C helper's)."""
    mixed = counters + np.uint64(_MIX_INCREMENT)  # SplitMix64 adds its increment first
    for shift, multiplier in zip((30, 27), _MIX_MULTIPLIERS):
        mixed ^= mixed >> np.uint64(shift)
        mixed *= multiplier
    mixed ^= mixed >> np.uint64(31)
    return mixed


def window_permutations(seed: int, first: int, count: int, size: int, stride: int) -> np.ndarray[Any, Any]:
    """The permutations of windows ``first`` to ``first + count - 1``, one row each, of ``size`` positions.

    Window ``w`` is shuffled by Fisher-Yates from its last position down: position ``i`` swaps with
    ``j = (d >> 32) * (i + 1) >> 32`` (in ``[0, i]``), where ``d`` is SplitMix64's mix of the counter
    ``seed + w * stride + i``. Only integer arithmetic modulo 2**64, so every machine draws the same, and the
    C helper's ``WindowDealer`` computes the same permutations window by window; the counters make any
    window's permutation computable on its own, in any order. The C helper computes them here too, when it
    is built (a window of a million positions: 14 ms, where the numpy twin's swaps take 0.4 s).
    """
    compact = _store._compact
    if compact is None:
        return numpy_window_permutations(seed, first, count, size, stride)
    permutations = np.empty((count, size), dtype=np.int64)
    compact.window_permutations(seed, first, count, size, stride, permutations)
    return permutations


def numpy_window_permutations(seed: int, first: int, count: int, size: int, stride: int) -> np.ndarray[Any, Any]:
    """``window_permutations`` without the C helper: the counters mixed in numpy for all windows at once,
    then the swaps, one numpy step per column (or one Python step per swap for a few long windows)."""
    counters: np.ndarray[Any, Any] = np.arange(first, first + count, dtype=np.uint64)[:, None] * np.uint64(stride)
    counters = counters + np.arange(size, dtype=np.uint64) + np.uint64(seed % 2**64)  # one row per window
    mixed = splitmix64(counters)
    mixed >>= np.uint64(32)
    mixed *= np.arange(1, size + 1, dtype=np.uint64)  # below 2**64: i + 1 <= size < 2**32
    mixed >>= np.uint64(32)
    swap_with = mixed.astype(np.intp)
    if count < _VECTOR_ROWS:  # few, long rows (a window longer than the epoch): one Python step per swap
        rows = []
        for draws in swap_with.tolist():
            permutation = list(range(size))
            for i in range(size - 1, 0, -1):
                j = draws[i]
                permutation[i], permutation[j] = permutation[j], permutation[i]
            rows.append(permutation)
        return np.array(rows, dtype=np.int64).reshape(count, size)
    permutations = np.tile(np.arange(size, dtype=np.int64), (count, 1))
    every_row = np.arange(count)
    for i in range(size - 1, 0, -1):  # one numpy step per column, for all rows at once
        j = swap_with[:, i]
        taken = permutations[every_row, j]
        permutations[every_row, j] = permutations[:, i]
        permutations[:, i] = taken
    return permutations


def last_round_start(total: int, world: int) -> int:
    """The first position of the epoch's last round of ``world`` among ``total`` dealt positions: every rank keeps
    that round's items, which the consistency digest hashes whole, in every mode."""
    return (total - 1) // world * world


def last_window(span: PlanSpan) -> tuple[int, int]:
    """How many positions the epoch's last window permutes, and how many of them it deals.

    It deals the positions up to ``total``. With padding (``total >= length``) it permutes just those, the
    padding among them. When ``pad=False`` cuts the sequence (``total < length``), the cut tail joins the last
    window: the window permutes it with its own positions and deals the first ``total`` of them, so the items
    dropped are drawn anew each epoch rather than always being the sampler's last ones. A window longer than
    ``window`` draws with its own length as the counters' stride, which keeps its counters clear of the
    earlier windows' (see ``window_permutations``)."""
    last_start = (span.total - 1) // span.window * span.window
    return max(span.total, span.length) - last_start, span.total - last_start


def _read_end(span: PlanSpan) -> int:
    """One past the last sampler position a plan reads: positions from ``length`` on are padding, never read;
    the plan of the last window also reads the tail that ``pad=False`` cuts (see ``last_window``)."""
    stop = min(span.end * span.window, span.total)
    return span.length if stop == span.total else min(stop, span.length)


def window_plan(span: PlanSpan) -> WindowPlan:
    """Plan windows ``first`` to ``end - 1`` in blocks of ``windows_per_block`` windows from ``first``: which
    positions this rank keeps, and in what order it yields them. A plan of a few positions (the head's windows
    and the last window, which every epoch plans) is made in plain Python, where numpy's cost per call would be
    most of the work; a longer one in numpy, so that the Python work per block stays a few calls. Both make the
    same plan."""
    planned = min(span.end * span.window, span.total) - span.first * span.window
    return (python_window_plan if planned <= _PYTHON_PLAN_POSITIONS else numpy_window_plan)(span)


def python_window_plan(span: PlanSpan) -> WindowPlan:
    """``window_plan`` for a few positions, step by step: the reference for ``numpy_window_plan``'s arrays."""
    seed, first, end, window, total, length, windows_per_block, blocks_per_sample, head_end, world, rank = span
    last = (total - 1) // window  # the epoch's last window (see last_window)
    start = first * window
    stop = min(end * window, total)
    rows: List[tuple[int, List[int]]] = []  # per window: its offset from start, its permutation
    if first < min(end, last):
        count = min(end, last) - first
        permutations = window_permutations(seed, first, count, window, window).tolist()
        rows.extend(zip(range(0, count * window, window), permutations))
    if end > last:
        size, dealt = last_window(span)
        permutation = window_permutations(seed, last, 1, size, max(size, window))[0].tolist()
        rows.append(((last - first) * window, permutation[:dealt]))
    own = [offset + position for offset, permutation in rows for position in permutation[rank::world]]
    read_end = _read_end(span) - start
    block_size = windows_per_block * window
    block_starts = range(0, stop - start, block_size)
    block_read_ends = [min(block_start + block_size, read_end) for block_start in block_starts]
    block_read_ends[-1] = read_end  # the last window's tail, which pad=False cuts, is read with its block
    keep = bytearray(read_end)
    for position in own:
        if position < read_end:
            keep[position] = 1
    for block_read_end in block_read_ends:
        keep[block_read_end - 1] = 1  # each block's last position: runs out alike on every rank
    tail = min(max(0, last_round_start(total, world) - start), read_end)
    keep[tail:] = b"\x01" * (read_end - tail)  # the epoch's last round: every rank keeps it (the digest hashes it)
    head = max(0, min(head_end - start, read_end))
    keep[:head] = b"\x01" * head  # the head: every rank keeps it
    kept_before = list(accumulate(keep, initial=0))  # kept positions before p
    own_per_block = window // world * windows_per_block
    kept_in_last_block = kept_before[read_end] - kept_before[block_starts[-1]]
    order = []  # each own position's index among its block's kept items
    for number, position in enumerate(own):
        if position + start < length:
            order.append(kept_before[position] - kept_before[block_starts[number // own_per_block]])
        else:  # padding: the head is appended after the last block's kept items
            order.append(kept_in_last_block + (position + start - length) % length)
    sampled_ends = sampled_block_ends(first, end, windows_per_block, blocks_per_sample)
    sampled = {(sampled_end - first - 1) // windows_per_block for sampled_end in sampled_ends}  # blocks ending there
    blocks = []
    for number, (block_start, read_stop) in enumerate(zip(block_starts, block_read_ends)):
        blocks.append(
            WindowBlock(
                start + block_start,
                kept_before[read_stop] - kept_before[block_start],
                min(max(head_end - start - block_start, 0), read_stop - block_start),
                block_start,
                read_stop,
                min(number * own_per_block, len(own)),
                min((number + 1) * own_per_block, len(own)),
                last=stop == total and number == len(block_starts) - 1,
                sampled=number in sampled,
            )
        )
    return WindowPlan(bytes(keep), np.array(order, dtype=np.int64), blocks)


def numpy_window_plan(span: PlanSpan) -> WindowPlan:
    """``window_plan`` with all index arithmetic in numpy, for many windows at once."""
    seed, first, end, window, total, length, windows_per_block, blocks_per_sample, head_end, world, rank = span
    last = (total - 1) // window  # the epoch's last window (see last_window)
    parts = []
    if first < min(end, last):
        count = min(end, last) - first
        own = window_permutations(seed, first, count, window, window)[:, rank::world]
        parts.append((own + np.arange(0, count * window, window)[:, None]).reshape(-1))
    if end > last:
        size, dealt = last_window(span)
        own = window_permutations(seed, last, 1, size, max(size, window))[0, :dealt][rank::world]
        parts.append(own + (last - first) * window)
    per_window = window // world
    start = first * window
    stop = min(end * window, total)
    own = np.concatenate(parts) if len(parts) > 1 else parts[0]  # yield order, relative to `start`
    read_end = _read_end(span) - start
    keep = np.zeros(read_end, dtype=np.bool_)
    keep[own[own < read_end]] = True
    block_starts = np.arange(0, stop - start, windows_per_block * window)
    block_read_ends = np.minimum(block_starts + windows_per_block * window, read_end)
    block_read_ends[-1] = read_end  # the last window's tail, which pad=False cuts, is read with its block
    keep[block_read_ends - 1] = True  # each block's last position: runs out alike on every rank
    keep[max(0, last_round_start(total, world) - start) :] = True  # the epoch's last round: every rank keeps it
    keep[: max(0, min(head_end - start, read_end))] = True  # the head: every rank keeps it
    kept_before = np.concatenate(([0], np.cumsum(keep, dtype=np.int32)))  # kept positions before p
    block_of = np.arange(len(own), dtype=np.int32) // (per_window * windows_per_block)
    kept = kept_before[block_read_ends] - kept_before[block_starts]
    padded = own + start >= length
    index = kept_before[np.minimum(own, read_end)] - kept_before[block_starts[block_of]]
    if padded.any():  # the head is appended after the last block's kept items
        index[padded] = kept[-1] + (own[padded] + start - length) % length
    order_bounds = np.searchsorted(block_of, np.arange(len(block_starts) + 1)).tolist()
    heads = np.clip(head_end - start - block_starts, 0, block_read_ends - block_starts)
    sampled_ends = sampled_block_ends(first, end, windows_per_block, blocks_per_sample)
    sampled = np.zeros(len(block_starts), dtype=np.bool_)
    sampled[[(sampled_end - first - 1) // windows_per_block for sampled_end in sampled_ends]] = True  # they end there
    blocks = [
        WindowBlock(
            start + block_start, kept_count, head, block_start, read_stop, order_start, order_end, sampled=is_sampled
        )
        for block_start, read_stop, kept_count, head, (order_start, order_end), is_sampled in zip(
            block_starts.tolist(),
            block_read_ends.tolist(),
            kept.tolist(),
            heads.tolist(),
            zip(order_bounds, order_bounds[1:]),
            sampled.tolist(),
        )
    ]
    if stop == total:
        blocks[-1] = blocks[-1]._replace(last=True)
    return WindowPlan(keep.tobytes(), index, blocks)

"""What does dealing a custom batch sampler out among DDP ranks cost one rank?

Everything runs in one process that plays rank 0 of a world of W ranks (num_replicas=W, rank=0): no
process group is needed, because every contender takes num_replicas and rank explicitly.

The workload is a typical user batch sampler (it subclasses nothing, has ``__len__`` and ``__iter__``,
and yields lists of 64 ints: consecutive slices of a permutation it holds as a numpy array). For B
batches per epoch (default 1e4, 1e5, 1e6) and W ranks (default 2 and 8) it compares:

1. floor: iterating the user's sampler once on its own. A rank cannot learn which batches are its
   share without running the user's sampler through the whole epoch (the sampler may build batches
   itself, so there is nothing to index into), so one full pass of it is the least any dealing
   scheme can cost per epoch. Ratios are taken against this.
2. ours, shuffle off:       ``DistributedBatchSamplerWrapper(s, W, 0)``
3. ours, windowed shuffle:  ``DistributedBatchSamplerWrapper(s, W, 0, shuffle=True, shuffle_window=16)``
4. ours, full shuffle:      ``DistributedBatchSamplerWrapper(s, W, 0, shuffle=True)``
5. Lightning's ``DistributedSamplerWrapper`` (``lightning.fabric.utilities.distributed``, which the
   Trainer uses) applied to the batch sampler with shuffle=False: its ``_DatasetSamplerWrapper``
   materialises the epoch as a Python list of all B batches on every rank, every epoch.
6. the hand-written pattern: ``batches = list(sampler)`` then the positions of a plain
   ``DistributedSampler(range(len(batches)), W, 0, shuffle=False)``.

For each it measures:

* epoch seconds: create the iterator and drain this rank's whole share (``collections.deque(it,
  maxlen=0)``, so the consumer adds next to nothing); the minimum over a few rounds (a single round for
  an epoch over 5 s). Each timed epoch is the second of a fresh wrapper, whose first epoch runs untimed
  just before it, so that what a wrapper carries from one epoch into the next is paid as in training
  (Lightning's wrapper builds the next epoch's list while it still holds the last one, then frees that);
  construction is not timed; ``set_epoch`` is called as a training loop would.
* x floor: every timed run is paired with a run of the floor right beside it (alternately before and
  after), and the ratio is the median over rounds of run / its floor run (three times the rounds for
  contenders whose epoch takes under a second: short pairs are the noisiest). The host's speed drifts by
  tens of percent over minutes, much more than within one pair, so a ratio of two minima taken minutes
  apart would mostly measure that drift.
  The clock is this process's CPU time (``time.process_time``): in training each rank has its own core,
  and CPU time barely moves when other processes compete for the machine, where wall time can double.
  ``--wall`` times with ``time.perf_counter`` instead.
* time to first batch: ``iter()`` plus the first ``next()``; the minimum over the timed epochs and
  extra first-batch-only samples while they are cheap.
* peak extra memory: a separate pass under ``tracemalloc`` (which slows allocation down a lot, so it
  is never mixed with timing): start tracing, build the wrapper, iterate two epochs, read the peak.
  tracemalloc sees Python objects, numpy buffers and our C store, but not torch tensor storage: the full
  shuffle's permutation (8 bytes per batch, a torch tensor while it is drawn, before the store fills)
  is not seen; this rank's share of it, kept for the epoch, is a numpy copy and is. Each pass costs
  minutes at B=1e6 (tracemalloc makes every allocation ~30x dearer), so passes are shared where
  the answer cannot differ: Lightning's wrapper and the hand-written pattern hold all B batches whatever
  W is (one pass per B; Lightning's takes several GB at B=1e6), and the floor holds one batch whatever
  B is (one pass, at the smallest B). Our wrapper gets a pass for every (B, W).

It ends with PASS/FAIL lines for the targets set for our wrapper (see ``check_targets``) and exits 1 when
any fails.

Run it (about 10-15 minutes on 2 cores; ``--quick`` runs B=1e4 and 1e5 only, in about two minutes)::

    python benchmarks/sampler_overhead.py
    python benchmarks/sampler_overhead.py --quick
    python benchmarks/sampler_overhead.py --sizes 1e4,1e6 --worlds 8 --plot ratios.png

Wall-clock timings (``--wall``) are only meaningful on an otherwise idle machine; the load average is
printed at start and end either way.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import lightning
import numpy as np
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper as LightningSamplerWrapper
from torch.utils.data import DistributedSampler

from lightning_ddp_ext import _store
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper

BATCH_SIZE = 64
SHUFFLE_WINDOW = 16
DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000, 100_000)
DEFAULT_WORLDS = (2, 8)
DEFAULT_ROUNDS = 5
EXPENSIVE_EPOCH_S = 5.0  # a contender whose epoch takes longer is timed once: noise is small next to it
# A contender whose epoch takes less than CHEAP_EPOCH_S gets CHEAP_ROUNDS_FACTOR times the rounds: short
# pairs are the noisiest (a pause of a millisecond moves a 12 ms epoch by 8 %) and the cheapest to repeat.
CHEAP_EPOCH_S = 1.0
CHEAP_ROUNDS_FACTOR = 3
FIRST_BATCH_BUDGET_S = 0.25  # extra time-to-first-batch samples are drawn while they cost less than this
FIRST_BATCH_MAX_SAMPLES = 25
MB = 1e6


# --------------------------------------------------------------------------------------------- workload
class UserBatchSampler:
    """A custom batch sampler as users write them: no base class, just ``__len__`` and ``__iter__``.

    It holds a fixed permutation of the dataset's indices and yields consecutive 64-index slices of it as
    lists of Python ints, which is about as cheap as a real batch sampler gets (so overheads show).
    """

    def __init__(self, num_batches: int, batch_size: int = BATCH_SIZE, seed: int = 0) -> None:
        self.num_batches = num_batches
        self.batch_size = batch_size
        self._order = np.random.default_rng(seed).permutation(num_batches * batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[List[int]]:
        order, size = self._order, self.batch_size
        for start in range(0, self.num_batches * size, size):
            yield order[start : start + size].tolist()


class ListThenDistributedSampler:
    """The pattern written by hand: materialise the epoch's batches, then deal positions with a stock
    ``DistributedSampler`` over ``range(len(batches))``."""

    def __init__(self, batch_sampler: UserBatchSampler, num_replicas: int, rank: int) -> None:
        self.batch_sampler = batch_sampler
        self.positions = DistributedSampler(range(len(batch_sampler)), num_replicas, rank, shuffle=False)

    def set_epoch(self, epoch: int) -> None:
        self.positions.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.positions)

    def __iter__(self) -> Iterator[List[int]]:
        batches = list(self.batch_sampler)  # per epoch: the user's sampler may reshuffle
        for position in self.positions:
            yield batches[position]


# --------------------------------------------------------------------------------------------- contenders
Factory = Callable[[UserBatchSampler, int, int], Iterable[List[int]]]


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    make: Factory  # (user sampler, num_replicas, rank) -> what a rank iterates
    ordered: bool  # yields batches rank, rank+W, ... in the sampler's order (checked by the sanity pass)
    memory_pass: str = "each"  # "each" (B, W); "per_size": once per B (W-independent); "once": O(1) by design

    def memory_key(self, num_batches: int, world: int) -> Tuple[Any, ...]:
        """Cells sharing this key share one tracemalloc pass."""
        return {"each": (self.key, num_batches, world), "per_size": (self.key, num_batches), "once": (self.key,)}[
            self.memory_pass
        ]


CONTENDERS: Tuple[Contender, ...] = (
    Contender("floor", "floor: user sampler alone", lambda s, w, r: s, ordered=False, memory_pass="once"),
    Contender("off", "ours, shuffle off", lambda s, w, r: DistributedBatchSamplerWrapper(s, w, r), ordered=True),
    Contender(
        "window",
        f"ours, shuffle_window={SHUFFLE_WINDOW}",
        lambda s, w, r: DistributedBatchSamplerWrapper(s, w, r, shuffle=True, shuffle_window=SHUFFLE_WINDOW),
        ordered=False,
    ),
    Contender(
        "full",
        "ours, full shuffle",
        lambda s, w, r: DistributedBatchSamplerWrapper(s, w, r, shuffle=True),
        ordered=False,
    ),
    Contender(
        "lightning",
        "Lightning DistributedSamplerWrapper",
        lambda s, w, r: LightningSamplerWrapper(s, num_replicas=w, rank=r, shuffle=False),
        ordered=True,
        memory_pass="per_size",
    ),
    Contender(
        "handwritten",
        "list() + DistributedSampler",
        lambda s, w, r: ListThenDistributedSampler(s, w, r),
        ordered=True,
        memory_pass="per_size",
    ),
)
BY_KEY = {contender.key: contender for contender in CONTENDERS}


@dataclass
class Result:
    epoch_s: float
    ratio: float  # epoch time / floor's: median over rounds of each run against the floor run beside it
    first_batch_s: float
    peak_bytes: int
    memory_cell: Tuple[int, int]  # the (B, W) whose tracemalloc pass gave peak_bytes (see Contender.memory_pass)


Results = Dict[Tuple[int, int, str], Result]  # (B, W, contender key) -> Result


# --------------------------------------------------------------------------------------------- measuring
_STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"  [{time.perf_counter() - _STARTED:6.0f} s] {message}", file=sys.stderr, flush=True)


def start_epoch(sampler: Iterable[Any], epoch: int) -> None:
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


Clock = Callable[[], float]


def time_epoch(sampler: Iterable[Any], epoch: int, clock: Clock) -> Tuple[float, float]:
    """Seconds to drain one epoch of ``sampler``, and seconds to its first batch."""
    start_epoch(sampler, epoch)
    gc.collect()
    start = clock()
    iterator = iter(sampler)
    next(iterator)
    first = clock()
    deque(iterator, maxlen=0)
    end = clock()
    return end - start, first - start


def time_first_batch(sampler: Iterable[Any], epoch: int, clock: Clock) -> float:
    """Fastest ``iter()`` + first ``next()`` over as many samples as fit in FIRST_BATCH_BUDGET_S."""
    start_epoch(sampler, epoch)
    gc.collect()
    best = float("inf")
    deadline = time.perf_counter() + FIRST_BATCH_BUDGET_S
    for _ in range(FIRST_BATCH_MAX_SAMPLES):
        start = clock()
        iterator = iter(sampler)
        next(iterator)
        best = min(best, clock() - start)
        del iterator
        if time.perf_counter() > deadline:
            break
    return best


def peak_memory(contender: Contender, user: UserBatchSampler, world: int) -> int:
    """Peak bytes traced while building ``contender`` and iterating two epochs of it, above the start (the
    second epoch shows what a wrapper holds while one epoch gives way to the next)."""
    gc.collect()
    tracemalloc.start()
    try:
        baseline, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        sampler = contender.make(user, world, 0)
        for epoch in (0, 1):
            start_epoch(sampler, epoch)
            deque(iter(sampler), maxlen=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del sampler
    gc.collect()
    return peak - baseline


def measure_cell(
    user: UserBatchSampler,
    world: int,
    rounds: int,
    clock: Clock,
    memory_cache: Dict[Tuple[Any, ...], Tuple[int, Tuple[int, int]]],
) -> Dict[str, Result]:
    """All measurements for one (B, W): interleaved timing rounds, first-batch samples, memory passes."""
    epoch_times: Dict[str, List[float]] = {c.key: [] for c in CONTENDERS}
    first_times: Dict[str, List[float]] = {c.key: [] for c in CONTENDERS}
    ratios: Dict[str, List[float]] = {c.key: [] for c in CONTENDERS}
    floor = CONTENDERS[0]

    def timed(contender: Contender, round_index: int) -> float:
        sampler = contender.make(user, world, 0)
        if contender is not floor:  # time a second epoch: what a wrapper carries into it is paid as in training
            start_epoch(sampler, round_index)
            deque(iter(sampler), maxlen=0)
        epoch_s, first_s = time_epoch(sampler, round_index + 1, clock)
        del sampler
        gc.collect()
        epoch_times[contender.key].append(epoch_s)
        first_times[contender.key].append(first_s)
        progress(f"round {round_index + 1}  {contender.label:<38} epoch {epoch_s:8.3f} s")
        return epoch_s

    for round_index in range(rounds * CHEAP_ROUNDS_FACTOR):
        for contender in CONTENDERS[1:]:
            times = epoch_times[contender.key]
            if times and min(times) > (EXPENSIVE_EPOCH_S if round_index < rounds else CHEAP_EPOCH_S):
                continue
            # Each run is paired with a floor run right beside it (before it in even rounds, after it in odd
            # ones): this machine's speed drifts by tens of percent over minutes, far more than within a pair.
            if round_index % 2 == 0:
                floor_s = timed(floor, round_index)
                epoch_s = timed(contender, round_index)
            else:
                epoch_s = timed(contender, round_index)
                floor_s = timed(floor, round_index)
            ratios[contender.key].append(epoch_s / floor_s)
    ratios[floor.key] = [1.0]

    for contender in CONTENDERS:
        if min(first_times[contender.key]) < FIRST_BATCH_BUDGET_S:
            sampler = contender.make(user, world, 0)
            first_times[contender.key].append(time_first_batch(sampler, 0, clock))
            del sampler
            gc.collect()

    results: Dict[str, Result] = {}
    for contender in CONTENDERS:
        memory_key = contender.memory_key(len(user), world)
        if memory_key not in memory_cache:
            progress(f"memory pass  {contender.label} (tracemalloc, slow)")
            started = time.perf_counter()
            memory_cache[memory_key] = (peak_memory(contender, user, world), (len(user), world))
            progress(
                f"memory pass  {contender.label}: {memory_cache[memory_key][0] / MB:.2f} MB"
                f" in {time.perf_counter() - started:.1f} s"
            )
        peak_bytes, memory_cell = memory_cache[memory_key]
        results[contender.key] = Result(
            epoch_s=min(epoch_times[contender.key]),
            ratio=statistics.median(ratios[contender.key]),
            first_batch_s=min(first_times[contender.key]),
            peak_bytes=peak_bytes,
            memory_cell=memory_cell,
        )
    return results


def sanity_check(worlds: Sequence[int], num_batches: int = 1000) -> List[str]:
    """Check on a small epoch that every contender deals what it should; returns the problems found."""
    user = UserBatchSampler(num_batches, seed=1)
    batches = [tuple(batch) for batch in user]
    problems = []
    for world in worlds:
        for contender in CONTENDERS[1:]:
            shares = []
            for rank in range(world):
                sampler = contender.make(user, world, rank)
                start_epoch(sampler, 3)
                shares.append([tuple(batch) for batch in sampler])
            if contender.ordered and shares[0] != batches[0::world]:
                problems.append(f"{contender.label}, W={world}: rank 0 does not get batches 0, W, 2W, ...")
            if any(len(share) != -(-num_batches // world) for share in shares):
                problems.append(f"{contender.label}, W={world}: share lengths {sorted({len(s) for s in shares})}")
            if sorted(batch for share in shares for batch in share) != sorted(batches):
                problems.append(f"{contender.label}, W={world}: the ranks' shares do not partition the epoch")
    return problems


# --------------------------------------------------------------------------------------------- reporting
def size_label(value: int) -> str:
    exponent = len(str(value)) - 1
    return f"1e{exponent}" if value == 10**exponent and exponent >= 3 else str(value)


def format_table(results: Results, num_batches: int, world: int) -> str:
    header = f"{'contender':<38} {'epoch s':>9} {'x floor':>8} {'1st batch ms':>13} {'peak extra MB':>14}"
    lines = [f"B={size_label(num_batches)} batches of {BATCH_SIZE}, W={world} (rank 0)", header, "-" * len(header)]
    borrowed = []
    for contender in CONTENDERS:
        result = results[(num_batches, world, contender.key)]
        note = " "
        if result.memory_cell != (num_batches, world):
            borrowed.append(f"{contender.key} from B={size_label(result.memory_cell[0])} W={result.memory_cell[1]}")
            note = "*"
        lines.append(
            f"{contender.label:<38} {result.epoch_s:9.3f} {result.ratio:7.2f}x"
            f" {result.first_batch_s * 1e3:13.3f} {result.peak_bytes / MB:13.2f}{note}"
        )
    if borrowed:
        lines.append(f"* memory pass shared ({'; '.join(borrowed)}): see Contender.memory_pass")
    return "\n".join(lines)


@dataclass
class Check:
    passed: bool
    text: str


def check_targets(results: Results, sizes: Sequence[int], worlds: Sequence[int]) -> List[Check]:
    """The targets for our wrapper.

    Shuffle off and windowed: epoch <= 1.05x floor at every size; time to first batch at the largest B
    within 2x of that at the smallest; peak extra memory <= 5 MB at the largest B, and not growing with B
    (at most 2x that at the smallest B).
    Full shuffle: epoch <= 1.5x floor at every size; peak memory <= 0.25x Lightning's at the largest B.
    """
    small, large = min(sizes), max(sizes)
    checks: List[Check] = []

    def get(num_batches: int, world: int, key: str) -> Result:
        return results[(num_batches, world, key)]

    for key in ("off", "window"):
        label = BY_KEY[key].label
        for world in worlds:
            for num_batches in sizes:
                ratio = get(num_batches, world, key).ratio
                where = f"(B={size_label(num_batches)}, W={world})"
                checks.append(Check(ratio <= 1.05, f"{label}: epoch <= 1.05x floor  {where}: {ratio:.3f}x"))
            if small != large:
                first_small = get(small, world, key).first_batch_s
                first_large = get(large, world, key).first_batch_s
                ratio = first_large / first_small
                checks.append(
                    Check(
                        ratio <= 2.0,
                        f"{label}: 1st batch at B={size_label(large)} <= 2x B={size_label(small)}  (W={world}):"
                        f" {first_large * 1e3:.3f} ms vs {first_small * 1e3:.3f} ms = {ratio:.2f}x",
                    )
                )
            peak = get(large, world, key).peak_bytes / MB
            where = f"(B={size_label(large)}, W={world})"
            checks.append(Check(peak <= 5.0, f"{label}: peak extra <= 5 MB  {where}: {peak:.2f} MB"))
            if small != large:  # and not growing with B (twice the smallest B's is generous for noise)
                peak_small = get(small, world, key).peak_bytes / MB
                checks.append(
                    Check(
                        peak <= 2 * peak_small,
                        f"{label}: peak extra at B={size_label(large)} <= 2x B={size_label(small)}  (W={world}):"
                        f" {peak:.2f} MB vs {peak_small:.2f} MB",
                    )
                )

    label = BY_KEY["full"].label
    for world in worlds:
        for num_batches in sizes:
            ratio = get(num_batches, world, "full").ratio
            where = f"(B={size_label(num_batches)}, W={world})"
            checks.append(Check(ratio <= 1.5, f"{label}: epoch <= 1.5x floor  {where}: {ratio:.3f}x"))
        ours = get(large, world, "full").peak_bytes
        theirs = get(large, world, "lightning").peak_bytes
        checks.append(
            Check(
                ours <= 0.25 * theirs,
                f"{label}: peak <= 0.25x Lightning's  (B={size_label(large)}, W={world}):"
                f" {ours / MB:.1f} MB vs {theirs / MB:.1f} MB = {ours / theirs:.3f}x",
            )
        )
    return checks


def plot_ratios(results: Results, sizes: Sequence[int], worlds: Sequence[int], path: str) -> None:
    """Grouped bars of epoch time / floor per (B, W), one bar per contender."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written", file=sys.stderr)
        return
    cells = [(b, w) for b in sizes for w in worlds]
    contenders = CONTENDERS[1:]
    width = 0.8 / len(contenders)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.6 * len(cells)), 4.5))
    for index, contender in enumerate(contenders):
        ratios = [results[(b, w, contender.key)].ratio for b, w in cells]
        axes.bar([i + index * width for i in range(len(cells))], ratios, width, label=contender.label)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.axhline(1.05, color="green", linestyle="--", linewidth=0.8, label="target 1.05x (off, windowed)")
    axes.axhline(1.5, color="orange", linestyle="--", linewidth=0.8, label="target 1.5x (full shuffle)")
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    axes.set_xticklabels([f"B={size_label(b)}\nW={w}" for b, w in cells])
    axes.set_ylabel("epoch time / floor (user sampler alone)")
    axes.set_title(f"Per-rank epoch cost of dealing a batch sampler (batches of {BATCH_SIZE})")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot written to {path}")


# --------------------------------------------------------------------------------------------- main
def parse_counts(text: str) -> List[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_counts, help="batches per epoch, e.g. 1e4,1e5,1e6 (default)")
    parser.add_argument("--worlds", type=parse_counts, help="world sizes, e.g. 2,8 (default)")
    parser.add_argument("--quick", action="store_true", help="B=1e4,1e5 only (unless --sizes is given)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="timed epochs per contender (min is kept)")
    parser.add_argument("--wall", action="store_true", help="time with wall clock instead of process CPU time")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of the ratio table (needs matplotlib)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    sizes = sorted(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    worlds = sorted(args.worlds or DEFAULT_WORLDS)
    started = time.perf_counter()
    # Move the ~350k objects of the torch/Lightning imports out of the collector's reach: gc.collect() between
    # measurements then takes microseconds instead of ~0.3 s, and full collections triggered while a
    # contender builds lists do not rescan them (which only flatters the list-building contenders).
    gc.collect()
    gc.freeze()
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__},"
        f" numpy {np.__version__}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    helper = "built" if _store._compact is not None else "NOT built: the wrappers run their pure-Python paths"
    print(f"C helper of the sampler wrappers (lightning_ddp_ext._compact): {helper}")
    clock = time.perf_counter if args.wall else time.process_time
    print(
        f"B = {', '.join(map(size_label, sizes))}; W = {', '.join(map(str, worlds))}; rounds = {args.rounds}"
        f" ({args.rounds * CHEAP_ROUNDS_FACTOR} for epochs under {CHEAP_EPOCH_S:g} s);"
        f" clock: {'wall (perf_counter)' if args.wall else 'process CPU time (process_time)'}\n",
        flush=True,
    )

    problems = sanity_check(worlds)
    for problem in problems:
        print(f"SANITY FAIL: {problem}", flush=True)

    results: Results = {}
    memory_cache: Dict[Tuple[Any, ...], Tuple[int, Tuple[int, int]]] = {}
    for num_batches in sizes:
        progress(f"building the user sampler, B={size_label(num_batches)}")
        user = UserBatchSampler(num_batches)
        for world in worlds:
            progress(f"B={size_label(num_batches)} W={world}")
            for key, result in measure_cell(user, world, args.rounds, clock, memory_cache).items():
                results[(num_batches, world, key)] = result
            print(format_table(results, num_batches, world) + "\n", flush=True)
        del user
        gc.collect()

    print("Targets for our wrapper")
    checks = check_targets(results, sizes, worlds)
    checks += [Check(False, f"sanity: {problem}") for problem in problems] or [
        Check(True, "sanity: every contender deals the expected shares (B=1000)")
    ]
    for check in checks:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.text}")
    failed = sum(not check.passed for check in checks)
    print(f"\n{len(checks) - failed}/{len(checks)} passed", end="")
    print(f"; load average {os.getloadavg()[0]:.2f} at end; {time.perf_counter() - started:.0f} s in all")
    if args.plot:
        plot_ratios(results, sizes, worlds, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What does dealing cost one rank, counted rather than timed?

``sampler_overhead.py`` times epochs, and on a shared 2-core machine its ratios move by several percent from
run to run, as much as the 1.05x targets leave. This script counts instead, under valgrind's callgrind:
the instructions one epoch executes, and the level-1 data-cache misses a simulated core (48 KiB, 12-way,
64-byte lines, the size of the machines this package is tested on) takes, per user batch. The counts repeat
exactly for the same inputs, whatever else the machine does, so they say where an overhead comes from: extra
work (instructions) or a larger working set (misses, each a trip to the level-2 cache).

The workload and contenders are ``sampler_overhead.py``'s (rank 0 of W, batches of 64 indices), and so is
the floor: the user's sampler alone. Only the epoch is counted: each contender runs in a child process
under callgrind with collection on inside CPython's ``deque(..., maxlen=0)`` drain (``consume_iterator``),
after the imports and a warm-up pass that iterates the user's sampler once without it; the objects made
up to there are frozen out of the collector's reach (``gc.freeze()``, as in the timed script), and the child
runs with ``PYTHONHASHSEED=0``, so that set and dict orders, and with them the counts, repeat exactly.

Run it (needs valgrind, e.g. ``apt-get install valgrind``). Each count takes 10-15 minutes on these machines,
nearly all of it importing torch under valgrind, two at a time on 2 cores: the default (4 counts) about half
an hour. Each count is printed as it completes, and the table at the end::

    python benchmarks/sampler_instructions.py                 # B = 1e4, W = 2
    python benchmarks/sampler_instructions.py --sizes 1e4,1e5 --worlds 2,8
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import sys
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import run_process_tree  # noqa: E402
from sampler_overhead import BY_KEY, UserBatchSampler, parse_counts, size_label  # noqa: E402

CONTENDERS = ("floor", "off", "window", "full")
# The simulated level-1 data cache (size, associativity, line) and the last level (the 2 MiB of L2 a core
# has to itself on these machines).
D1 = "49152,12,64"
LL = "2097152,16,64"
DRAIN = "consume_iterator"  # CPython's C function behind deque(iterable, maxlen=0)
COUNT_TIMEOUT_S = 3600  # one count takes 10-15 minutes; one that hangs is killed


def child(key: str, num_batches: int, world: int) -> None:
    """Run in the process callgrind watches: warm up, then drain one epoch of ``key`` (the counted part)."""
    user = UserBatchSampler(num_batches)
    for _ in user:  # warm-up outside the counted function
        pass
    gc.collect()  # as sampler_overhead.py times: no collection of the start-up's objects inside the count
    gc.freeze()
    sampler = BY_KEY[key].make(user, world, 0)
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(0)
    deque(iter(sampler), maxlen=0)


def count(key: str, num_batches: int, world: int, workdir: str) -> Tuple[int, int]:
    """(instructions, D1 misses) of one epoch of ``key`` under callgrind."""
    out = os.path.join(workdir, f"{key}-{num_batches}-{world}.out")
    command = [
        "valgrind", "--tool=callgrind", "--cache-sim=yes", f"--D1={D1}", f"--LL={LL}", "--collect-atstart=no",
        f"--toggle-collect={DRAIN}", f"--callgrind-out-file={out}",
        sys.executable, __file__, "--child", key, str(num_batches), str(world),
    ]
    env = dict(os.environ, PYTHONHASHSEED="0")  # str hashes (so set and dict orders) repeat from run to run
    status, stderr = run_process_tree(command, timeout=COUNT_TIMEOUT_S, env=env, capture=True)
    match = re.search(r"Collected : (\d+) (\d+) (\d+) \d+ (\d+) (\d+)", stderr)
    if status != 0 or match is None:
        raise RuntimeError(f"callgrind run of {key} (B={num_batches}, W={world}) failed:\n{stderr[-2000:]}")
    instructions, _, _, read_misses, write_misses = (int(group) for group in match.groups())
    if instructions == 0:
        raise RuntimeError(f"nothing was counted inside {DRAIN}: is this CPython with its symbols?")
    print(f"  {key} (B={num_batches}, W={world}): {instructions} instructions, {read_misses + write_misses} D1 misses",
          file=sys.stderr, flush=True)
    return instructions, read_misses + write_misses


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_counts, default=[10_000], help="batches per epoch (default 1e4)")
    parser.add_argument("--worlds", type=parse_counts, default=[2], help="world sizes (default 2)")
    parser.add_argument("--child", nargs=3, metavar=("KEY", "B", "W"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind (or see sampler_overhead.py for timings)")
        return 1
    cells = [(key, size, world) for size in args.sizes for world in args.worlds for key in CONTENDERS]
    print(f"Counting {len(cells)} epochs under callgrind, {os.cpu_count()} at a time...", file=sys.stderr)
    with tempfile.TemporaryDirectory() as workdir, ThreadPoolExecutor(os.cpu_count()) as pool:
        counts: Dict[Tuple[str, int, int], Tuple[int, int]] = dict(
            zip(cells, pool.map(lambda cell: count(*cell, workdir), cells))
        )
    rows: List[str] = [
        f"{'B':>5} {'W':>2}  {'contender':<30} {'instr/batch':>11} {'x floor':>8} {'D1 miss/batch':>13} {'x floor':>8}"
    ]
    for key, size, world in cells:
        instructions, misses = counts[(key, size, world)]
        floor_instructions, floor_misses = counts[("floor", size, world)]
        rows.append(
            f"{size_label(size):>5} {world:>2}  {BY_KEY[key].label:<30} {instructions / size:>11.0f}"
            f" {instructions / floor_instructions:>8.3f} {misses / size:>13.1f} {misses / floor_misses:>8.3f}"
        )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

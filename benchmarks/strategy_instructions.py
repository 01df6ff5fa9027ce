"""What does "ddp_custom_sampler" add to a training step, counted rather than timed?

``strategy_overhead.py`` times steps of 3-4 ms, which vary 2x from fit to fit on a shared 2-core machine, so
its 1.02 target stays "not resolved" there. This script counts instead: the instructions rank 0's main thread
executes per training batch, under valgrind's callgrind, for the same jobs and fits (``strategy_overhead._fit``).
Counts repeat for the same inputs whatever else the machine does, so a 2 % difference is resolved.

Rank 0 runs under callgrind; rank 1, which Lightning's popen launcher starts, runs natively (it waits for
rank 0 at every collective). All fits run in these two processes: a warm-up fit of each strategy (lazy
imports, first-call caches), then ``REPEATS`` rounds of one fit per job and strategy, each fit counted from
the start of its second epoch to the end of training (its first epoch warms the fit up). So a count per batch
holds fetching the batch (the sampler, collation), the step, and each epoch's share of its start and end.
Callgrind writes a dump at each ``os.sched_yield()`` (``--dump-before``), which a callback calls at those two
points, after a ``gc.collect()`` and a ``gc.freeze()`` (no count walks what earlier fits left). Only the main
thread is counted (``--separate-threads``): gloo's threads do the same all-reduces under both strategies, but
how often they wake depends on when rank 1's data arrives. One intra-op thread (``OMP_NUM_THREADS=1``: a pool's
idle threads spin, a count that depends on timing) and ``PYTHONHASHSEED=0``. The table shows every round, so
how well the counts repeat is on it.

Run it (needs valgrind): ``python benchmarks/strategy_instructions.py``, about 10 minutes on 2 cores (torch and
Lightning import for 3 of them under valgrind).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import run_process_tree  # noqa: E402
from strategy_overhead import BATCH, JOBS, SAMPLES, TARGET_RATIO, _fit  # noqa: E402

MARKER = "os_sched_yield"  # CPython's C function behind os.sched_yield(): callgrind dumps before each call
REPEATS = 3
RUN_TIMEOUT_S = 3600  # the run takes about 10 minutes; one that hangs is killed
BATCHES_PER_RANK_EPOCH = SAMPLES // BATCH // 2  # both jobs deal SAMPLES // BATCH batches to 2 ranks


def _mark(label: str, labels: List[str]) -> None:
    """End callgrind's current dump here; the counts from here to the next mark go under ``label``. The
    objects made so far are frozen out of the collector's reach, so no count walks what earlier fits left."""
    gc.collect()
    gc.freeze()
    os.sched_yield()
    labels.append(label)


def _counting_callback(label: str, labels: List[str]) -> Any:
    """A Lightning callback that counts epochs 1 to the last under ``label`` (epoch 0 warms the fit up)."""
    from lightning.pytorch import Callback

    class CountEpochs(Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch == 1:
                _mark(label, labels)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            _mark("between", labels)

    return CountEpochs()


def worker(counted_epochs: int, out: str) -> None:
    """Rank 0 under callgrind (rank 1 re-runs this natively): every fit, its counted epochs marked. Writes the
    dumps' labels to ``out`` and, as it goes, a line per fit to ``out + ".progress"`` (rank 0 only)."""
    progress = Path(out + ".progress") if os.environ.get("LOCAL_RANK", "0") == "0" else None

    def report(line: str) -> None:
        if progress is not None:
            with progress.open("a") as stream:
                stream.write(line + "\n")

    labels: List[str] = ["start-up"]
    report("warm-up: one fit per job and strategy")
    for job, baseline, ours in JOBS:
        for strategy in (baseline, ours):
            _fit(job, strategy, 0, 1)  # counted under "start-up"
    fits = [(repeat, job, strategy) for repeat in range(REPEATS) for job, *pair in JOBS for strategy in pair]
    for number, (repeat, job, strategy) in enumerate(fits, 1):
        report(f"fit {number} of {len(fits)}: {job} job, {strategy}")
        callback = _counting_callback(f"{job}|{strategy}|{repeat}", labels)
        _fit(job, strategy, 0, 1 + counted_epochs, [callback])
    from lightning_ddp_ext import _exit

    # Stock "ddp" leaves its group to exit, where Gloo's threads can abort the process: the package's clean-up
    # destroys it (after letting Gloo's threads settle on torch < 2.8).
    _exit.destroy_process_group()
    if progress is not None:
        Path(out).write_text(json.dumps(labels))


def main_thread_totals(prefix: str) -> List[int]:
    """The main thread's instructions in each callgrind dump, in the order written: ``prefix.1-01``,
    ``prefix.2-01``, ... then ``prefix-01`` (the rest, at exit)."""
    directory, name = Path(prefix).parent, Path(prefix).name
    numbered = sorted(directory.glob(f"{name}.*-01"), key=lambda p: int(p.name[len(name) + 1 : -len("-01")]))
    totals = []
    for path in [*numbered, directory / f"{name}-01"]:
        match = re.search(r"^totals: (\d+)", path.read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{path} has no 'totals:' line: is it a callgrind dump?")
        totals.append(int(match.group(1)))
    return totals


def per_batch(counts: Dict[str, int], job: str, strategy: str, counted_epochs: int, repeat: int) -> float:
    """Instructions per batch over the counted epochs of one fit."""
    return counts[f"{job}|{strategy}|{repeat}"] / (counted_epochs * BATCHES_PER_RANK_EPOCH)


def verdict(ratios: Sequence[float], target: float) -> str:
    """PASS when every repeat's ratio is at or below ``target``, FAIL when every one is above, else "split"."""
    if all(ratio <= target for ratio in ratios):
        return "PASS"
    return "FAIL" if all(ratio > target for ratio in ratios) else "split (the counts did not repeat)"


def _print_progress(run: "Future[Any]", progress: Path) -> None:
    """Echo the worker's progress lines to stderr, with the minutes since the start, until ``run`` is done."""
    start, shown = time.monotonic(), 0
    while True:
        done = run.done()  # read before the lines, so the last lines are shown too
        lines = progress.read_text().splitlines() if progress.exists() else []
        for line in lines[shown:]:
            print(f"  [{(time.monotonic() - start) / 60:4.1f} min] {line}", file=sys.stderr, flush=True)
        shown = len(lines)
        if done:
            return
        time.sleep(2)


def count(counted_epochs: int, workdir: str) -> Dict[str, int]:
    """Run the worker under callgrind; instructions per labelled dump."""
    prefix = os.path.join(workdir, "rank0.out")
    labels_path = os.path.join(workdir, "labels.json")
    command = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", f"--dump-before={MARKER}",
        f"--callgrind-out-file={prefix}",
        sys.executable, __file__, "--worker", str(counted_epochs), labels_path,
    ]
    drop = ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(run_process_tree, command, timeout=RUN_TIMEOUT_S, cwd=workdir, env=env, capture=True)
        _print_progress(run, Path(labels_path + ".progress"))
        status, stderr = run.result()
    if status != 0 or not os.path.exists(labels_path):
        raise RuntimeError(f"the callgrind run exited with status {status}:\n{stderr[-3000:]}")
    labels: List[str] = json.loads(Path(labels_path).read_text())
    totals = main_thread_totals(prefix)
    if len(totals) != len(labels):
        raise RuntimeError(f"{len(totals)} callgrind dumps for {len(labels)} marks: was {MARKER} called elsewhere?")
    return {label: total for label, total in zip(labels, totals) if label not in ("start-up", "between")}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--epochs", type=int, default=2, help="epochs counted per fit, after one of warm-up (default 2)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("COUNTED_EPOCHS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), args.worker[1])
        return 0
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind (or see strategy_overhead.py for timings)")
        return 1
    print("Counting rank 0 under callgrind (about 10 minutes)...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        counts = count(args.epochs, workdir)
    print(f"{'job':7} {'strategy':32} " + " ".join(f"{f'repeat {r + 1}':>12}" for r in range(REPEATS)))
    ratios: Dict[str, List[float]] = {}
    for job, baseline, ours in JOBS:
        rows = {s: [per_batch(counts, job, s, args.epochs, r) for r in range(REPEATS)] for s in (baseline, ours)}
        for strategy in (baseline, ours):
            label = strategy + (" (dealt by hand)" if job == "custom" and strategy == "ddp" else "")
            print(f"{job:7} {label:32} " + " ".join(f"{value:12.0f}" for value in rows[strategy]))
        ratios[job] = [b / a for a, b in zip(rows[baseline], rows[ours])]
    print("\ninstructions per batch, ddp_custom_sampler / ddp, per repeat:")
    print(f"plain job (a BatchSampler):           {' '.join(f'{r:.4f}' for r in ratios['plain'])}"
          f"   target <= {TARGET_RATIO}: {verdict(ratios['plain'], TARGET_RATIO)}")
    print(f"custom job (against dealing by hand): {' '.join(f'{r:.4f}' for r in ratios['custom'])}   (no target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

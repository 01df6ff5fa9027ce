"""The verdicts of the strategy benchmarks: a wrong interval or a misread count would print PASS on noise.

``strategy_overhead.py`` judges timed pairs by an order-statistic interval; ``strategy_instructions.py`` reads
callgrind's dumps in the order they were written and spreads a fit's count over its batches."""
from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import List

import pytest
from benchmark_scripts import load_benchmark


@pytest.mark.parametrize(("n", "k"), [(5, 1), (6, 1), (10, 2), (20, 6), (30, 10)])
def test_median_interval_takes_the_textbook_order_statistics(n: int, k: int) -> None:
    """k-th smallest and k-th largest of n (1-based): the distribution-free 95 % interval for the median."""
    values = [float(v) for v in random.Random(n).sample(range(1000), n)]
    ordered = sorted(values)
    assert load_benchmark("strategy_overhead").median_interval(values) == (ordered[k - 1], ordered[n - k])


def test_median_interval_covers_the_true_median_at_least_as_often_as_it_claims() -> None:
    median_interval = load_benchmark("strategy_overhead").median_interval
    draw = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):
        values = [draw.lognormvariate(0.0, 0.3) for _ in range(10)]  # true median exp(0) = 1
        low, high = median_interval(values)
        assert low <= statistics.median(values) <= high
        covered += low <= 1.0 <= high
    assert covered / trials >= 0.95  # 97.9 % exactly for n = 10; 2000 trials keep the draw well above 0.95


def _write_dump(path: Path, instructions: int) -> None:
    header = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\n"
    path.write_text(f"{header}summary: {instructions}\ntotals: {instructions}\n")


def test_callgrind_dumps_are_read_in_the_order_they_were_written(tmp_path: Path) -> None:
    """The main thread's dumps ``.1-01`` .. ``.10-01`` in numeric order (not ``.1, .10, .2``), then ``-01``, the
    rest; other threads' dumps (``-02``) are not counted."""
    for number in range(1, 11):
        _write_dump(tmp_path / f"rank0.out.{number}-01", number * 100)
        _write_dump(tmp_path / f"rank0.out.{number}-02", 1)
    _write_dump(tmp_path / "rank0.out-01", 7)
    _write_dump(tmp_path / "rank0.out-02", 1)
    totals = load_benchmark("strategy_instructions").main_thread_totals(str(tmp_path / "rank0.out"))
    assert totals == [*range(100, 1100, 100), 7]


def test_a_file_that_is_no_callgrind_dump_is_named(tmp_path: Path) -> None:
    (tmp_path / "rank0.out-01").write_text("not a dump")
    with pytest.raises(RuntimeError, match="rank0.out-01 has no 'totals:' line"):
        load_benchmark("strategy_instructions").main_thread_totals(str(tmp_path / "rank0.out"))


def test_the_count_per_batch_spreads_a_fits_count_over_its_counted_batches() -> None:
    script = load_benchmark("strategy_instructions")
    counts = {"plain|ddp|0": 2 * script.BATCHES_PER_RANK_EPOCH * 123_456}
    assert script.per_batch(counts, "plain", "ddp", 2, 0) == 123_456


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [([1.004, 1.006], "PASS"), ([1.02, 1.0], "PASS"), ([1.03, 1.05], "FAIL"), ([1.01, 1.03], "split")],
)
def test_the_counted_verdict_needs_every_repeat_on_the_same_side(ratios: List[float], expected: str) -> None:
    assert load_benchmark("strategy_instructions").verdict(ratios, 1.02).startswith(expected)

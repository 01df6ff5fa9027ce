"""The verdict statistics of ``benchmarks/strategy_overhead.py``: a wrong interval would print PASS on noise."""
from __future__ import annotations

import random
import statistics

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

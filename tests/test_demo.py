"""The demo (`make demo`) runs end to end on 2 processes through the popen launcher."""
from __future__ import annotations

import re
from pathlib import Path

from distributed_helpers import run_python, tools_python

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo_pk_digits.py"


def test_demo_partitions_batches_and_reports_recall(tmp_path: Path) -> None:
    result = run_python(str(DEMO), "--epochs", "2", timeout=300, cwd=tmp_path, python=tools_python("sklearn"))
    lines = re.findall(r"epoch (\d): rank 0 (\d+), rank 1 (\d+) of (\d+) batches.*complete: (\w+)", result.stdout)
    assert [(epoch, r0, r1, ok) for epoch, r0, r1, _, ok in lines] == [
        ("0", "11", "11", "yes"),
        ("1", "11", "11", "yes"),
    ]
    recall = re.search(r"after epoch 1: (\d\.\d+)", result.stdout)
    assert recall is not None and float(recall.group(1)) > 0.5, result.stdout[-2000:]

"""The test harness itself: ``run_distributed`` leaves no process behind, whatever its ranks started."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import List

import pytest
from distributed_helpers import descendants, describe, run_distributed, stat_fields, worker_context
from torch.utils.data import DataLoader


def _start_a_worker_then_get_killed(rank: int, world_size: int, record: str) -> None:
    """Start a DataLoader worker from a fork server (as the tests' ranks do), note the rank's descendants,
    then die by SIGKILL, as a rank the harness kills at its deadline does: nothing shuts the worker down."""
    loader = DataLoader(range(8), batch_size=2, num_workers=1, multiprocessing_context=worker_context())
    iterator = iter(loader)
    next(iterator)
    Path(record).write_text(json.dumps(descendants(os.getpid())))
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pids: List[int]) -> List[int]:
    return [pid for pid in pids if (fields := stat_fields(pid)) is not None and fields[0] != "Z"]


def test_run_distributed_kills_what_a_killed_rank_started(tmp_path: Path) -> None:
    """A fork server's workers are its children, not the rank's, and outlive a rank killed by a signal:
    run_distributed must kill them too (each rank leads a process group), or they idle on the machine."""
    record = tmp_path / "descendants.json"
    with pytest.raises(AssertionError, match="rank 0: no result"):
        run_distributed(_start_a_worker_then_get_killed, 1, str(record), timeout=120)
    started = json.loads(record.read_text())
    assert len(started) >= 2, f"expected a fork server and its worker, the rank started {started}"
    deadline = time.monotonic() + 10  # SIGKILL takes effect when the killed process is next scheduled
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(started), f"left behind:\n{describe(_alive(started))}"

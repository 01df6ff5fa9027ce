"""The test harness itself: ``run_distributed`` leaves no process behind, whatever its ranks started, and
``call_on_ranks`` makes each call whatever the one before did."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import (
    Outcome, call_in_a_new_process, call_on_ranks, descendants, describe, run_distributed, shared_directory,
    stat_fields, worker_context,
)
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


def _export_a_seed_then_fail_on_rank_1() -> int:
    os.environ["PL_GLOBAL_SEED"] = "7"  # as seed_everything does
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails here")
    return dist.get_rank()


def _where_am_i() -> Tuple[int, Optional[str], str, int]:
    ranks = torch.tensor(dist.get_rank())
    dist.all_reduce(ranks)  # the process group still pairs the ranks up
    return dist.get_rank(), os.environ.get("PL_GLOBAL_SEED"), os.environ["LOCAL_RANK"], int(ranks)


def _leave_a_file_in_the_shared_directory() -> None:
    (shared_directory("notes") / f"from rank {dist.get_rank()}").touch()
    dist.barrier()


def _list_the_shared_directory() -> Tuple[str, List[str]]:
    notes = shared_directory("notes")
    return str(notes), sorted(path.name for path in notes.iterdir())


def test_call_on_ranks_makes_every_call_on_the_same_ranks_in_a_clean_environment() -> None:
    """Also: a file a call leaves in the shared directory is there for every rank in the next call, and the
    directory is gone once the ranks are."""
    outcomes = call_on_ranks(
        {
            "fails on rank 1": (_export_a_seed_then_fail_on_rank_1, ()),
            "next": (_where_am_i, ()),
            "leave": (_leave_a_file_in_the_shared_directory, ()),
            "list": (_list_the_shared_directory, ()),
        }
    )
    assert outcomes["fails on rank 1"][0].returned() == 0
    outcomes["fails on rank 1"][1].raised("ValueError: rank 1 fails here")
    with pytest.raises(AssertionError, match="rank 1 fails here"):
        outcomes["fails on rank 1"][1].returned()
    assert outcomes.returned("next") == [(0, None, "0", 1), (1, None, "1", 1)]
    with pytest.raises(AssertionError, match="returned 0 instead of raising"):
        Outcome(value=0).raised("anything")
    assert repr(outcomes) == "<outcomes of 4 calls on 2 ranks>"
    outcomes.returned("leave")
    (directory, files), same = outcomes.returned("list")
    assert same == (directory, files) and files == ["from rank 0", "from rank 1"]
    assert not Path(directory).exists()


def _what_a_script_has() -> Tuple[bool, List[str], str, int]:
    os.environ["PL_GLOBAL_SEED"] = "7"  # as seed_everything does: not for the next call
    torchrun_variables = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK") if name in os.environ]
    return dist.is_initialized(), torchrun_variables, os.environ["MASTER_ADDR"], os.getpid()


def _make_a_group_of_one_then_fail() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1)  # env://: MASTER_ADDR and MASTER_PORT, as a strategy does
    raise ValueError("failed after making the group")


def _the_group_and_the_pid() -> Tuple[int, Optional[str], int]:
    return dist.get_world_size(), os.environ.get("PL_GLOBAL_SEED"), os.getpid()


def test_call_in_a_new_process_starts_as_a_script_and_keeps_the_group_a_call_made() -> None:
    """No group and no torchrun variables to start with, a free address to make one on; a later call (after one
    that raised) finds the group made, in the same process, which is not this one."""
    outcomes = call_in_a_new_process(
        {
            "start": (_what_a_script_has, ()),
            "make": (_make_a_group_of_one_then_fail, ()),
            "after": (_the_group_and_the_pid, ()),
        }
    )
    *start, first_pid = outcomes["start"].returned()
    assert start == [False, [], "127.0.0.1"]
    outcomes["make"].raised("ValueError: failed after making the group")
    world_size, seed, pid = outcomes["after"].returned()
    assert (world_size, seed) == (1, None) and pid == first_pid != os.getpid()

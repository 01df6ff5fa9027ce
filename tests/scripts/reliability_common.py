"""Shared by the reliability tests and their standalone scripts: fault injection, process hygiene, records.

Module-level classes only, so that spawned ranks can unpickle them. Process helpers read ``/proc`` (Linux),
so they need no third-party package.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))  # for `scenarios` when this runs from a script

import torch  # noqa: E402
from distributed_helpers import (  # noqa: E402
    command_line,
    descendants,
    describe,
    free_port,
    kill_pids,
    session_members,
    worker_context,
)
from scenarios import EveryThirdFirst, IndexDataset, PKBatches, Recorder, labels_for, trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_ddp_ext import CustomDDP  # noqa: E402

#: Process-group timeout used by every reliability run: a fault must resolve well within it.
PG_TIMEOUT_S = 20
#: Slack for starting Python, torch and Lightning on a busy 2-core machine, on top of the PG timeout.
STARTUP_SLACK_S = 150

INJECTED_MESSAGE = "injected fault"


# ---------------------------------------------------------------------------------------------- processes
def wait_until(condition: Callable[[], bool], timeout_s: float, period_s: float = 0.2) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passed; return whether it held (a bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(period_s)
    return condition()


def kill_session(session_id: int) -> None:
    """SIGKILL every process of a session (by process group and one by one, for those that left the group)."""
    try:
        os.killpg(session_id, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    kill_pids(session_members(session_id))


def job_env(port: Optional[int] = None, **extra: str) -> Dict[str, str]:
    """Environment for a job started from a test: no inherited distributed settings, a fresh MASTER_PORT."""
    env = dict(os.environ)
    for key in (
        "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
        "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_JOB_NAME",
        "PL_GLOBAL_SEED", "PL_SEED_WORKERS",  # a seed_everything in the test process seeds the job's samplers
    ):
        env.pop(key, None)
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(port if port is not None else free_port())
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------- training
def strategy(start_method: str = "popen", strategy_class: Any = CustomDDP, **options: Any) -> CustomDDP:
    """CustomDDP (or ``strategy_class``) with a small process-group timeout, so that a fault resolves quickly."""
    return strategy_class(start_method=start_method, timeout=timedelta(seconds=PG_TIMEOUT_S), **options)


def pk_loader(size: int = 48, seed: int = 1, num_workers: int = 0) -> DataLoader:
    """P x K batches (2 classes x 4 samples): ``size // 8`` batches per epoch, different every epoch."""
    sampler = PKBatches(labels_for(size), p=2, k=4, seed=seed)
    context = worker_context("lightning.pytorch") if num_workers else None  # workers re-run a script's imports
    return DataLoader(
        IndexDataset(size), batch_sampler=sampler, num_workers=num_workers, multiprocessing_context=context
    )


#: How long a rank with the fault "raise_exiting_late" takes to end once it has closed its connections.
LATE_EXIT_S = 8.0


class _SleepsWhenFreed:
    """Held by a module global, so it is freed late in the interpreter's shutdown: after the exit handlers, one
    of which destroys the process group and so fails the other ranks. Its process then ends only after theirs."""

    def __del__(self) -> None:
        time.sleep(LATE_EXIT_S)


_late_exit: Optional[_SleepsWhenFreed] = None


class FaultyRecorder(Recorder):
    """A Recorder whose rank ``fault_rank`` fails at its ``fault_step``-th training step: it raises (and with
    "raise_exiting_late" ends only well after the other ranks failed because of it), SIGKILLs itself, or hangs
    outside any collective (as a rank does whose DataLoader worker deadlocked)."""

    def __init__(self, out_dir: str, fault: Optional[str] = None, fault_rank: int = 1, fault_step: int = 2) -> None:
        super().__init__(out_dir)
        if fault not in (None, "raise", "raise_exiting_late", "sigkill", "hang"):
            raise ValueError(f"unknown fault {fault!r}")
        self.fault, self.fault_rank, self.fault_step = fault, fault_rank, fault_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fault is not None and self.global_rank == self.fault_rank and self.global_step == self.fault_step:
            mark(self.out_dir, f"rank{self.global_rank}.fault", f"{self.fault} at step {self.global_step}")
            if self.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "hang":
                time.sleep(24 * 3600)
            if self.fault == "raise_exiting_late":
                global _late_exit
                _late_exit = _SleepsWhenFreed()
            raise RuntimeError(f"{INJECTED_MESSAGE} on rank {self.global_rank} at step {self.global_step}")
        return super().training_step(batch, batch_idx)


class WeightRecorder(Recorder):
    """A Recorder that also saves its final weights, records warnings and the cluster it ran in."""

    def __init__(self, out_dir: Optional[str] = None) -> None:
        super().__init__(out_dir)
        self.layer = torch.nn.Linear(1, 2)
        self.captured: List[str] = []

    def setup(self, stage: str) -> None:
        original = warnings.showwarning

        def keep(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            self.captured.append(f"{category.__name__}: {message}")
            original(message, category, *args, **kwargs)

        warnings.showwarning = keep
        warnings.simplefilter("always")
        self.said: List[str] = []
        said = self.said

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                said.append(record.getMessage())

        self._keep = Keep()
        logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(self._keep)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)  # momentum: optimizer state matters

    def teardown(self, stage: str) -> None:
        logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(self._keep)
        environment = self.trainer.strategy.cluster_environment
        self.facts.update(
            warnings=self.captured,
            info=self.said,
            global_rank=self.global_rank,
            node_rank=self.trainer.node_rank,
            world_size=self.trainer.world_size,
            cluster_environment=type(environment).__name__,
            global_step=self.trainer.global_step,
        )
        if self.out_dir is not None:
            torch.save({k: v.detach().clone() for k, v in self.state_dict().items()},
                       Path(self.out_dir) / f"weights_rank{self.global_rank}.pt")
        super().teardown(stage)


def mark(out_dir: str, name: str, text: str) -> None:
    Path(out_dir, name).write_text(text)


def run_guarded(out_dir: str, rank_of: Callable[[], int], body: Callable[[], Any]) -> Any:
    """Run ``body``; on an exception write ``rank<R>.error`` with the traceback, then re-raise."""
    try:
        return body()
    except BaseException:
        mark(out_dir, f"rank{rank_of()}.error", traceback.format_exc())
        raise


def env_rank() -> int:
    """This process's global rank from the launcher's environment (0 before Lightning sets it)."""
    for key in ("RANK", "GLOBAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return int(os.environ.get("NODE_RANK", 0)) + int(os.environ.get("LOCAL_RANK", 0))


def read_json(path: Path) -> Dict[str, Any]:
    return json.loads(path.read_text())


__all__ = [
    "DataLoader", "EveryThirdFirst", "FaultyRecorder", "IndexDataset", "INJECTED_MESSAGE", "PG_TIMEOUT_S", "PKBatches",
    "STARTUP_SLACK_S", "WeightRecorder", "command_line", "descendants", "describe", "env_rank", "free_port",
    "job_env", "kill_pids", "kill_session", "labels_for", "mark", "pk_loader", "read_json", "run_guarded",
    "session_members", "strategy", "trainer_kwargs", "wait_until", "worker_context",
]


# ---------------------------------------------------------------------------------------------- pytest
def _helper_process(pid: int) -> bool:
    """Long-lived helpers of the test process itself, not job processes: multiprocessing's resource tracker
    and fork server, and Open MPI's ``orted``, which a process starts for itself where mpi4py is installed
    (Lightning's MPI detection initialises MPI on a Trainer's construction). Open MPI ends the test process
    as soon as its ``orted`` dies, so killing it as a leftover would end the whole test session."""
    command = command_line(pid)
    return any(helper in command for helper in ("resource_tracker", "forkserver", "orted "))


def children_baseline() -> set:
    return set(descendants(os.getpid()))


def assert_no_new_descendants(before: set, grace_s: float = 30.0) -> None:
    """Fail (after killing them) if processes started since ``before`` are still alive after ``grace_s``."""

    def leftovers() -> List[int]:
        return [pid for pid in descendants(os.getpid()) if pid not in before and not _helper_process(pid)]

    if not wait_until(lambda: not leftovers(), grace_s):
        survivors = leftovers()
        report = describe(survivors)
        kill_pids(survivors)
        raise AssertionError(f"processes outlived the job (killed now):\n{report}")

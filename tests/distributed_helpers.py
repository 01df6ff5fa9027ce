"""Run a function on N real gloo processes and collect each rank's return value.

Every test that needs real collectives goes through :func:`run_distributed`: it uses a ``file://``
rendezvous in a temporary directory (no ports to collide), a hard deadline, and kills every child that
is still alive when it returns or fails, so a hanging collective fails the test instead of the suite.
Each rank leads its own process group, so the processes it starts (a fork server, DataLoader workers) are
killed with it even when they outlive it. The process helpers read ``/proc`` (Linux).
"""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
import pickle
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 90.0


# ---------------------------------------------------------------------------------------------- processes
def stat_fields(pid: int) -> Optional[List[str]]:
    """Fields of ``/proc/PID/stat`` from the state on (state, parent, process group, session, ...), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its closing parenthesis.
    return raw[raw.rindex(")") + 2 :].split()


def _live_processes() -> Iterator[tuple[int, List[str]]]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None and fields[0] != "Z":  # a zombie has exited; only its parent's wait is due
                yield int(entry), fields


def session_members(session_id: int) -> List[int]:
    """Live processes of session ``session_id`` (a job started with ``start_new_session=True``)."""
    return [pid for pid, fields in _live_processes() if int(fields[3]) == session_id]


def group_members(group_ids: Collection[int]) -> List[int]:
    """Live processes of the process groups ``group_ids``."""
    return [pid for pid, fields in _live_processes() if int(fields[2]) in group_ids]


def descendants(root: int) -> List[int]:
    """Live descendants of ``root`` (children, grandchildren, ...)."""
    parents = {pid: int(fields[1]) for pid, fields in _live_processes()}
    found: List[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def describe(pids: List[int]) -> str:
    """One line per process: pid, parent, state and the kernel function it sleeps in, then its command.

    For failure messages: a job that never ends is told apart from one that is merely slow by who is left
    and where they wait (a worker parked in ``futex_wait`` since its fork, a rank polling for its data).
    """
    lines = []
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None:
            continue
        try:
            waiting_in = Path(f"/proc/{pid}/wchan").read_text().strip()
        except OSError:
            waiting_in = "?"
        if waiting_in in ("", "0"):  # running, or the kernel does not say
            waiting_in = "-"
        command = " ".join(command_line(pid).split())[:120]
        lines.append(f"  {pid} (parent {fields[1]}, state {fields[0]}, waiting in {waiting_in}): {command}")
    return "\n".join(lines) or "  (none)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def kill_pids(pids: List[int]) -> None:
    """SIGKILL each of ``pids`` that is still alive."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------------------------------------- ranks
def worker_context(*preload: str) -> multiprocessing.context.BaseContext:
    """The start method for DataLoader workers in a rank: a fork server, not a fork of the rank itself.

    CPython before 3.11.10 (3.10.15, 3.9.20) can deadlock a child forked while another thread of the parent
    is starting or ending (gh-112275), and a rank's threads do end: every finished DataLoader iterator ends
    its queue-feeder threads, and the next epoch forks its workers right after. A deadlocked worker hangs
    its rank, and through the next collective the job (about one run in 13 under load here). The fork
    server has a single thread, and starts workers faster than ``spawn``. Its workers are its children, so a
    rank killed by a signal leaves them and the server behind: ``run_distributed`` kills each rank's process
    group, and the tests that kill jobs kill whole sessions.

    ``preload``: installed modules the workers need besides torch, imported once in the server instead of
    in every worker. 3.11's server imports neither ``__main__`` (its default) nor anything off the default
    ``sys.path``. Call this in a fresh rank, before any worker starts: the preload list is the process's.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", *preload])
    return context


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, workdir: str, join_group: bool, args: tuple[Any, ...]
) -> None:
    os.setpgid(0, 0)  # lead a process group: run_distributed kills it whole, orphaned descendants included
    result_path = Path(workdir) / f"result_{rank}.pkl"
    try:
        if join_group:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{workdir}/rendezvous",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=60),
            )
        value = fn(rank, world_size, *args)
        payload: tuple[str, Any] = ("ok", value)
    except BaseException:  # report every failure, including assertion errors, to the parent
        payload = ("error", traceback.format_exc())
    result_path.write_bytes(pickle.dumps(payload))
    # Leave at once: neither tear the group down nor finalise the interpreter. On torch before 2.13 freeing a
    # Gloo group can deadlock (this thread holds the GIL and waits for the group's lock; a Gloo worker holds the
    # lock and waits for the GIL, to free a finished collective's tensor): a rank in four on torch 2.6, here.
    # Finalising with the group alive lets its threads take the GIL too. Neither is what a test checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if payload[0] == "ok" else 1)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, join_group: bool = True
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    ``fn`` must be importable (a module-level function). Returns the values in rank order and raises
    AssertionError with each failing rank's traceback, or after ``timeout`` seconds. With ``join_group=False``
    the processes start without a process group (``fn`` makes one, or none).
    """
    with tempfile.TemporaryDirectory() as workdir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, workdir, join_group, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            finished = False
            deadline = timeout
            step = 0.5
            waited = 0.0
            while not finished and waited < deadline:
                try:
                    finished = context.join(timeout=step)
                except mp.ProcessExitedException:
                    break
                waited += step
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
            # What the ranks started (a fork server and its DataLoader workers, say) may outlive them.
            kill_pids(group_members({process.pid for process in context.processes}))
        results: list[Any] = []
        errors: list[str] = []
        for rank in range(world_size):
            path = Path(workdir) / f"result_{rank}.pkl"
            if not path.exists():
                errors.append(f"rank {rank}: no result (killed, crashed or timed out after {timeout:.0f}s)")
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results


@dataclass(frozen=True)
class Outcome:
    """What one call of :func:`call_on_ranks` returned on one rank, or the traceback of what it raised."""

    value: Any = None
    error: Optional[str] = None

    def returned(self) -> Any:
        """The value the call returned; fails the test with the rank's traceback if it raised instead."""
        if self.error is not None:
            raise AssertionError(f"the call raised on its rank:\n{self.error}")
        return self.value

    def raised(self, pattern: str) -> None:
        """Fail unless the call raised an error whose traceback matches the regular expression ``pattern``."""
        assert self.error is not None, f"the call returned {self.value!r} instead of raising {pattern!r}"
        assert re.search(pattern, self.error, re.DOTALL), f"{pattern!r} not found in:\n{self.error}"


#: A named call for :func:`call_on_ranks`: ``name -> (function, arguments)``; the function must be importable.
RankCalls = Dict[str, Tuple[Callable[..., Any], Tuple[Any, ...]]]


#: Names the directory that the ranks of :func:`call_on_ranks` share (see :func:`shared_directory`).
SHARED_DIRECTORY_VARIABLE = "CALL_ON_RANKS_SHARED_DIRECTORY"


def shared_directory(name: str) -> Path:
    """The directory ``name`` shared by every rank of the running :func:`call_on_ranks`, made on first use and
    removed when the ranks are done: where a call saves checkpoints that it, or a later call, loads on every
    rank. Call it inside a call (a path computed where the calls are listed would be the listing process's)."""
    path = Path(os.environ[SHARED_DIRECTORY_VARIABLE]) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def one_process() -> Iterator[None]:
    """Hide the variables torchrun sets from a Trainer made on one of :func:`call_on_ranks`' ranks: a one-device
    Trainer there is a process of its own (its global rank 0), beside the ranks' runs: a reference to compare
    their runs with, made on every rank at once."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")
    hidden = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _call_each(rank: int, world_size: int, calls: RankCalls, shared: str) -> Dict[str, Outcome]:
    # What torchrun sets: Lightning's environment then takes the processes as started for it, and the strategy
    # joins the process group run_distributed made instead of launching ranks or making one.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # read by nothing: the process group exists already
    )
    return _make_calls(calls, shared)


def _call_alone(rank: int, world_size: int, calls: RankCalls, shared: str) -> Dict[str, Outcome]:
    # What `python script.py` has: no torchrun variables, so a one-device Trainer's strategy makes the group itself
    # (a world of one) on this address; later calls' strategies find it made and join it.
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return _make_calls(calls, shared)


def _make_calls(calls: RankCalls, shared: str) -> Dict[str, Outcome]:
    os.environ[SHARED_DIRECTORY_VARIABLE] = shared
    outcomes: Dict[str, Outcome] = {}
    for name, (function, args) in calls.items():
        environment = dict(os.environ)  # seed_everything exports its seed: not to the next call
        torch.seed()  # random draws unlike the other ranks' and the last call's, as in a new process
        random.seed()
        np.random.seed()
        try:
            outcomes[name] = Outcome(value=function(*args))
        except Exception:
            outcomes[name] = Outcome(error=traceback.format_exc())
        finally:
            os.environ.clear()
            os.environ.update(environment)
    return outcomes


class CallOutcomes(Dict[str, List[Outcome]]):
    """Each call's outcomes, in rank order, by the call's name. Its repr is short: pytest prints it in the
    report of every test that failed with it as an argument."""

    def __repr__(self) -> str:
        return f"<outcomes of {len(self)} calls on {len(next(iter(self.values()), []))} ranks>"

    def returned(self, name: str) -> List[Any]:
        """What the call ``name`` returned on each rank, in rank order; fails with a rank's traceback if it raised."""
        return [outcome.returned() for outcome in self[name]]


def call_on_ranks(calls: RankCalls, world_size: int = 2, timeout: float = 240.0) -> CallOutcomes:
    """Make each call on the same ``world_size`` ranks, one call after another, as a script run by torchrun
    makes several Trainers: the ranks start (and import Lightning, most of a short run's time) once for all of
    them. Returns each call's outcome per rank, in rank order; a call that raised does not stop the next.

    The ranks come from :func:`run_distributed` (its deadline and clean-up). Lightning's launchers are not
    involved: the tests of launching and exiting start their own ranks. Each call starts with the environment
    variables and fresh random seeds of a new process, but what else a process keeps (module globals, warnings
    given once per process) carries over from call to call: a run that checks such a count or warning resets
    it first, or starts ranks of its own. A call that leaves one rank in a collective the others never join fails
    at the process-group timeout, and leaves the group unusable for the calls after it: read the first failure.
    Files that ranks or calls share go in :func:`shared_directory`."""
    with tempfile.TemporaryDirectory(prefix="call_on_ranks-") as shared:
        per_rank = run_distributed(_call_each, world_size, calls, shared, timeout=timeout)
    return CallOutcomes({name: [outcomes[name] for outcomes in per_rank] for name in calls})


def call_in_a_new_process(calls: RankCalls, timeout: float = 240.0) -> Dict[str, Outcome]:
    """Make each call, one after another in the order given, in one new process that starts with no process group,
    as ``python script.py`` does: the first one-device Trainer's strategy makes a group (a world of one), and the
    later calls' strategies find it made. Returns each call's outcome by name; a call that raised does not stop
    the next. Environment, seeds and the shared directory are as in :func:`call_on_ranks`.

    For one-device fits of ``CustomDDP``: made in the pytest process instead, each fit's group had to be destroyed
    before the next test, and on torch < 2.8 that destroy can deadlock holding the GIL (docs/compatibility.rst;
    it most likely hung CI once). Here no group is ever destroyed: the process leaves with ``os._exit``."""
    with tempfile.TemporaryDirectory(prefix="call_in_a_new_process-") as shared:
        [outcomes] = run_distributed(_call_alone, 1, calls, shared, timeout=timeout, join_group=False)
    return outcomes


def free_env() -> dict[str, str]:
    """The environment for a subprocess that must not inherit this process's distributed settings."""
    env = dict(os.environ)
    # PL_GLOBAL_SEED too: a seed_everything in the test process would seed the subprocess's samplers.
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED",
                "PL_SEED_WORKERS"):
        env.pop(key, None)
    return env


TOOLS_PYTHON_VARIABLE = "LIGHTNING_DDP_EXT_TOOLS_PYTHON"


def tools_python(module: str) -> str:
    """The interpreter for a script that needs ``module`` (scikit-learn for the demo, matplotlib for the docs'
    figure). ``make test`` runs the suite in a venv without them, because where they are installed every
    ``import lightning`` imports scipy and matplotlib too (torchmetrics does), and names the venv that has them
    in ``LIGHTNING_DDP_EXT_TOOLS_PYTHON``. Without that variable: this interpreter, or a skip if it lacks
    ``module``."""
    python = os.environ.get(TOOLS_PYTHON_VARIABLE)
    if python:
        return python
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here and {TOOLS_PYTHON_VARIABLE} names no interpreter that has it "
                    "(make test sets it)")
    return sys.executable


def run_python(
    *args: str, timeout: float, cwd: Optional[Path] = None, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` (a script and its arguments, or ``-c CODE``; ``python`` is this interpreter unless
    given) in the environment of :func:`free_env`, and fail with the end of its stderr unless it exits 0.

    The script runs in a session of its own, and every process of that session still alive when it ends or
    times out is killed: a launcher's other ranks are its children, and one stuck outside a collective would
    outlive it."""
    command = [python, *args]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=free_env(), cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_pids(session_members(process.pid))
        stdout, stderr = process.communicate()
        raise AssertionError(f"{' '.join(args)[:200]} did not finish within {timeout:.0f} s:\n{stderr[-3000:]}")
    finally:
        kill_pids(session_members(process.pid))
    assert process.returncode == 0, stderr[-3000:]
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

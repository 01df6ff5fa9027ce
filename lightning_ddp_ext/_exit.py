"""Destroying the default process group before the interpreter exits, and letting go first of what holds it.

Framework-free (torch only, no Lightning): the strategy registers the exit handler when its
``init_ddp_connection`` made the default group, and itself, so that its held groups are released at exit.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import threading
import time
import weakref
from functools import cache
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist


class HoldsProcessGroups(Protocol):
    """What :func:`release_at_exit` takes: a strategy that can drop the process groups its wrapper, optimizers and
    gradient scaler hold."""

    def _release_process_groups(self) -> None: ...


#: The strategies whose ``setup_distributed`` ran in this process: at exit each lets go of the process groups it
#: holds (see `destroy_process_group`).
_STRATEGIES_SET_UP: "weakref.WeakSet[HoldsProcessGroups]" = weakref.WeakSet()
#: Before torch 2.8 a process group's destructor runs holding the GIL (pytorch/pytorch#154976 releases it), and
#: Gloo's waits for its worker threads (see `let_threads_settle`).
DESTRUCTOR_HOLDS_THE_GIL = torch.__version__ < "2.8"
#: How long `let_threads_settle` waits at most, and how often it looks.
SETTLE_TIMEOUT_S = 2.0
SETTLE_POLL_S = 0.005


def release_at_exit(strategy: HoldsProcessGroups) -> None:
    """Have ``strategy`` release its process groups at exit, before the default group is destroyed (held weakly:
    a strategy freed before then has nothing left to release)."""
    _STRATEGIES_SET_UP.add(strategy)


def destroy_process_group() -> None:
    """Destroy the default process group before the interpreter shuts down.

    Lightning does this for NCCL only. A Gloo group still alive at interpreter finalisation keeps its worker
    threads, and a worker that then takes the GIL (it does to free the tensors of a collective) aborts the
    process: SIGABRT, "terminate called without an active exception". A group lives on while anything holds
    it: in a spawned rank, multiprocessing keeps the trainer until finalisation, so that is dropped first
    (:func:`_release_finished_target`); under popen the script keeps it, so every strategy set up in this
    process lets go of the groups its model wrapper, optimizers and gradient scaler hold
    (``CustomDDP._release_process_groups``; the strategy registered itself with :func:`release_at_exit`).
    Garbage is collected next, freeing what held the group: a DDP wrapper freed after its group was destroyed
    can hang in its destructor (seen with plain torch, docs/examples/plain_torch.py). Before torch 2.8 the
    other threads are let settle first (:func:`let_threads_settle`).
    """
    if dist.is_available() and dist.is_initialized():
        _release_finished_target()
        _release_strategies_groups()
        gc.collect()
        if DESTRUCTOR_HOLDS_THE_GIL:
            let_threads_settle()
        dist.destroy_process_group()


@cache  # once per process
def destroy_process_group_at_exit() -> None:
    """Have :func:`destroy_process_group` run at exit, once per process: registered by ``setup_distributed``
    whenever the strategy's ``init_ddp_connection`` made the default group, the default one or an override."""
    atexit.register(destroy_process_group)


def _release_strategies_groups() -> None:
    """Let every strategy set up in this process release its process groups (a function of its own, so that no
    local variable keeps the last strategy alive through the garbage collection that follows)."""
    for strategy in list(_STRATEGIES_SET_UP):
        strategy._release_process_groups()


def _release_finished_target() -> None:
    """In a process started by multiprocessing, drop its finished target and arguments.

    ``multiprocessing`` keeps the process object (``current_process()``), and with it the arguments of its
    target (for Lightning's spawn launcher: the trainer), until the interpreter finalises. Exit handlers run
    after the target has returned, so nothing needs them any more. (Only spawned processes run exit handlers:
    forked ones end with ``os._exit``.)
    """
    if multiprocessing.parent_process() is not None:
        vars(multiprocessing.current_process()).update(_target=None, _args=(), _kwargs={})


def let_threads_settle(timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Sleep, the GIL released, until no other thread of this process is running or waiting to run; True if that
    happened within ``timeout_s``.

    Before torch 2.8 destroying a Gloo group holds the GIL while its destructor waits for the group's worker
    threads, and a worker that has just finished a collective takes the group's lock and then waits for the GIL
    to free that collective's tensors: neither moves again. On a loaded machine the worker can still be waiting
    to be scheduled when the main thread gets there (a rank hung at exit this way on torch 2.6, in CI). Asleep
    here, the main thread holds no GIL, so such a worker runs and finishes first. Threads are read from
    ``/proc/self/task`` (Linux): two looks in a row must find every other thread asleep. Elsewhere it sleeps
    ``SETTLE_POLL_S`` times ten and returns False. A thread that stays busy costs the whole ``timeout_s``.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        time.sleep(10 * SETTLE_POLL_S)
        return False
    own = str(threading.get_native_id())
    deadline, quiet = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
        quiet = quiet + 1 if not any(_is_running(tasks / task) for task in os.listdir(tasks) if task != own) else 0
        if quiet == 2:
            return True
    return False


def _is_running(task: Path) -> bool:
    """Whether the thread ``task`` (a ``/proc/<pid>/task/<tid>`` directory) is running or runnable."""
    try:
        stat = (task / "stat").read_text()
    except OSError:  # it ended meanwhile
        return False
    return stat[stat.rindex(")") + 2] == "R"  # the state follows the name, which may hold spaces and parentheses

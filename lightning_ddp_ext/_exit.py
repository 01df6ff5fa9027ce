"""Destroying the default process group before the interpreter exits, and letting go first of what holds it.

Framework-free (torch only, no Lightning): the strategy registers the exit handler when its
``init_ddp_connection`` made the default group, and itself, so that its held groups are released at exit.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import weakref
from functools import cache

import torch.distributed as dist
from typing import Protocol


class HoldsProcessGroups(Protocol):
    """What :func:`release_at_exit` takes: a strategy that can drop the process groups its wrapper, optimizers and
    gradient scaler hold."""

    def _release_process_groups(self) -> None: ...


#: The strategies whose ``setup_distributed`` ran in this process: at exit each lets go of the process groups it
#: holds (see `destroy_process_group`).
_STRATEGIES_SET_UP: "weakref.WeakSet[HoldsProcessGroups]" = weakref.WeakSet()


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
    can hang in its destructor (seen with plain torch, docs/examples/plain_torch.py).
    """
    if dist.is_available() and dist.is_initialized():
        _release_finished_target()
        _release_strategies_groups()
        gc.collect()
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

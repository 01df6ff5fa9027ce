"""The exit clean-up's wait for other threads to settle before a process group is destroyed (torch < 2.8, whose
destructor holds the GIL while Gloo's waits for its workers)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lightning_ddp_ext import _exit

needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread states from /proc (Linux)")


def _spin_until(done: threading.Event) -> None:
    while not done.is_set():
        pass


@needs_proc
def test_it_waits_for_a_running_thread_to_finish() -> None:
    """A thread that runs (here, needing the GIL the main thread gives up while it waits) has finished when it
    returns."""
    done = threading.Event()
    spinner = threading.Thread(target=_spin_until, args=(done,))
    spinner.start()
    timer = threading.Timer(0.2, done.set)
    timer.start()
    try:
        assert _exit.let_threads_settle(timeout_s=60)
        assert not spinner.is_alive()
    finally:
        done.set()
        spinner.join()
        timer.cancel()


@needs_proc
def test_a_thread_busy_for_good_costs_the_timeout_and_nothing_more() -> None:
    done = threading.Event()
    spinner = threading.Thread(target=_spin_until, args=(done,))
    spinner.start()
    try:
        assert not _exit.let_threads_settle(timeout_s=0.1)
        assert spinner.is_alive()
    finally:
        done.set()
        spinner.join()


@needs_proc
def test_sleeping_threads_do_not_hold_it_up() -> None:
    done = threading.Event()
    sleeper = threading.Thread(target=done.wait)
    sleeper.start()
    try:
        assert _exit.let_threads_settle(timeout_s=60)
        assert sleeper.is_alive()
    finally:
        done.set()
        sleeper.join()


@pytest.mark.parametrize(
    "name, state, running",
    [("python", "R", True), ("pt_gloo", "S", False), ("a) b (c", "R", True), ("x) R (y", "S", False)],
)
def test_a_threads_state_is_read_after_its_name(tmp_path: Path, name: str, state: str, running: bool) -> None:
    (tmp_path / "stat").write_text(f"4242 ({name}) {state} 1 4242 4242 0 -1\n")
    assert _exit._is_running(tmp_path) is running


def test_a_thread_that_ended_is_not_running(tmp_path: Path) -> None:
    assert _exit._is_running(tmp_path / "gone") is False


def test_the_wait_is_only_for_a_torch_whose_group_destructor_holds_the_gil() -> None:
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert _exit.DESTRUCTOR_HOLDS_THE_GIL is ((major, minor) < (2, 8))

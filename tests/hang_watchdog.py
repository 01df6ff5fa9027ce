"""A pytest plugin that ends the run, with every thread's stack, when a test outlives its timeout by a wide margin.

pytest-timeout interrupts a test with a signal, and Python runs signal handlers only between bytecodes: a main
thread blocked in C code that holds the GIL never gets there. Destroying a Gloo group on torch < 2.8 can block
so (docs/compatibility.rst), and most likely once did in CI, after a one-rank Trainer run in the pytest process
(the suite makes no group there since): it hung until CI's 90-minute limit, with nothing printed. faulthandler's
watchdog is a C thread that needs no GIL: armed for each test at its timeout plus ``GRACE_S``, it prints the
stacks to the terminal and exits with status 1, so such a hang fails the run in minutes and says where it was.
conftest.py loads it.
"""
from __future__ import annotations

import faulthandler
import os
from typing import Generator, Optional

import pytest

#: How long past its pytest-timeout a test may run before the watchdog ends the run: room for the fixture
#: teardown that follows an interrupted test (``spawn_job`` waits up to 50 s for ranks to go). The variable
#: ``HANG_WATCHDOG_GRACE_S`` overrides it (tests/test_hang_watchdog.py sets it short).
GRACE_S = float(os.environ.get("HANG_WATCHDOG_GRACE_S", "120"))

_terminal_fd: Optional[int] = None


def pytest_configure(config: pytest.Config) -> None:
    """Keep a descriptor of the terminal's stderr: while a test runs, pytest captures descriptor 2, and what the
    watchdog wrote there would be lost with the process. (pytest suspends its capture while plugins configure.)"""
    global _terminal_fd
    _terminal_fd = os.dup(2)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _terminal_fd
    if _terminal_fd is not None:
        os.close(_terminal_fd)
        _terminal_fd = None


def timeout_s(item: pytest.Item) -> Optional[float]:
    """The test's pytest-timeout: its ``timeout`` mark, else the ``timeout`` ini setting; None for none."""
    marker = item.get_closest_marker("timeout")
    value = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    return float(value) if value not in (None, "") and float(value) > 0 else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Generator[None, None, None]:
    """Arm the watchdog over the test's set-up, call and teardown (the span pytest-timeout times), then disarm."""
    limit = timeout_s(item)
    if limit is None or _terminal_fd is None:
        yield
        return
    faulthandler.dump_traceback_later(limit + GRACE_S, exit=True, file=_terminal_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()

"""The hang watchdog (hang_watchdog.py) on pytest runs of its own: a main thread blocked holding the GIL, which
pytest-timeout cannot interrupt, ends the run with the stack; tests that finish in time never set it off."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent

# A default pthread mutex locked twice by the same thread blocks for good; a PyDLL call keeps the GIL meanwhile,
# as torch < 2.8 does while destroying a Gloo group. (40 zero bytes are glibc's PTHREAD_MUTEX_INITIALIZER.)
BLOCKED_HOLDING_THE_GIL = """
import ctypes

import pytest


@pytest.mark.timeout(1)
def test_blocked_holding_the_gil():
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
"""

# Each test ends within its timeout, and together they outlast one timeout plus the grace.
FINISHING_IN_TIME = """
import time

import pytest


@pytest.mark.parametrize("number", range(3))
def test_finishes_in_time(number):
    time.sleep(1.2)
"""


def run_pytest(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a test module under a conftest.py that loads the watchdog as this suite's does."""
    loading = [line for line in (TESTS / "conftest.py").read_text().splitlines() if line.startswith("from hang_")]
    assert loading, "tests/conftest.py no longer loads the watchdog"
    (tmp_path / "conftest.py").write_text("\n".join(loading) + "\n")
    (tmp_path / "test_case.py").write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=str(TESTS), HANG_WATCHDOG_GRACE_S="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2", "test_case.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )


def test_a_test_blocked_holding_the_gil_ends_the_run_with_its_stack(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, BLOCKED_HOLDING_THE_GIL)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Timeout (0:00:02)!" in result.stderr, result.stderr
    assert 'line 12 in test_blocked_holding_the_gil' in result.stderr, result.stderr


def test_tests_that_finish_in_time_never_set_it_off(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, FINISHING_IN_TIME)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert "3 passed" in result.stdout and "Timeout" not in result.stderr, (result.stdout, result.stderr)

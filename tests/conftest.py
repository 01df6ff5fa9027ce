"""Fixtures shared by the test modules that start real ranks."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest
import torch.distributed
from hypothesis import HealthCheck, settings
from lightning.pytorch.strategies import StrategyRegistry

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from distributed_helpers import CallOutcomes, Outcome, call_in_a_new_process, call_on_ranks  # noqa: E402
from hang_watchdog import pytest_configure, pytest_runtest_protocol, pytest_unconfigure  # noqa: E402,F401
from reliability_common import PG_TIMEOUT_S, assert_no_new_descendants, children_baseline, free_port  # noqa: E402
from scenarios import TEST_PG_TIMEOUT  # noqa: E402

import lightning_ddp_ext  # noqa: E402

# Property tests: never fail on how long an example took to draw (a loaded 2-core machine is slow, not wrong).
# CI (.ci/run sets HYPOTHESIS_PROFILE=ci) draws the same examples every run, so a red CI always reproduces; a
# plain `make test` explores new ones each run and prints the seed of any failure.
settings.register_profile("dev", suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# A rank that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python stack to the captured output, so a
# rare crash in CI says where it happened: Python's faulthandler, inherited by every rank and script started here.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture
def spawn_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Loopback rendezvous on a fresh port for spawned ranks (restored afterwards: Lightning's launcher writes
    ``MASTER_PORT`` into this process), the short ``TEST_PG_TIMEOUT`` for the strategies picked by name,
    and a failure (killing them) if a rank outlives the test."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in lightning_ddp_ext.register():
        monkeypatch.setitem(StrategyRegistry[name]["init_params"], "timeout", TEST_PG_TIMEOUT)
    before = children_baseline()
    yield
    assert_no_new_descendants(before, grace_s=PG_TIMEOUT_S + 30)


NO_GROUP_HERE = (
    "a test tried to make a process group in the pytest process. Make it in a process of its own: "
    "distributed_helpers.call_in_a_new_process for one-device fits, call_on_ranks or run_distributed for ranks. "
    "A group made here must be destroyed before the next test, and on torch < 2.8 that destroy can deadlock "
    "holding the GIL, beyond pytest-timeout's reach (docs/compatibility.rst)."
)


@pytest.fixture(autouse=True)
def no_process_group_in_the_pytest_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse ``init_process_group`` here, where Lightning and the strategy look it up at each call. Spawned ranks
    and scripts start from a fresh interpreter, without this."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(NO_GROUP_HERE)

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)


@pytest.fixture(autouse=True)
def no_global_seed_left_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """``seed_everything`` exports ``PL_GLOBAL_SEED``, which seeds CustomDDP's samplers by default: a test that
    calls it in this process must not change the shares later tests (and their subprocesses) deal."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(name, "0")  # registers the original value (or its absence) for restoring
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def on_two_ranks(request: pytest.FixtureRequest) -> CallOutcomes:
    """The outcome on each of two ranks of every call in the test module's ``RANK_CALLS``, all made on the same
    two ranks, started once for the module (see ``distributed_helpers.call_on_ranks``), whichever of its tests
    run."""
    return call_on_ranks(request.module.RANK_CALLS)


@pytest.fixture(scope="module")
def in_one_process(request: pytest.FixtureRequest) -> Dict[str, Outcome]:
    """The outcome of every call in the test module's ``ONE_PROCESS_CALLS``, all made in one new process with no
    process group of its own to start with (see ``distributed_helpers.call_in_a_new_process``): one-device fits,
    kept out of the pytest process."""
    return call_in_a_new_process(request.module.ONE_PROCESS_CALLS)

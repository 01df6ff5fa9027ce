"""Fixtures shared by the test modules that start real ranks."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from reliability_common import PG_TIMEOUT_S, assert_no_new_descendants, children_baseline, free_port  # noqa: E402


@pytest.fixture
def spawn_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Loopback rendezvous on a fresh port for spawned ranks; fails (killing them) if a rank outlives the test."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    before = children_baseline()
    yield
    assert_no_new_descendants(before, grace_s=PG_TIMEOUT_S + 30)

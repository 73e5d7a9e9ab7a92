"""Fixtures for the operator tests: an emulated cluster (KMock + local kubelet + GC) with the real operator."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helper modules next to the tests (import mode: importlib)

from opsim import Cluster

FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Pods run the fake trainer (fast); the real trainer runs in test_op_e2e.py."""
    async with Cluster.start(tmp_path, command_map={"grstack": FAKE_TRAINER}) as c, c.operator():
        yield c

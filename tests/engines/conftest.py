"""Fixtures for the engine watchdog tests; helpers live in engines_harness.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines_harness import SimEngine  # noqa: E402


@pytest.fixture
def sims():
    started: list[SimEngine] = []

    def start(kind: str, *args: str, **kw) -> SimEngine:
        s = SimEngine(kind, *args, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()



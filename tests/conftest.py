"""Shared test fixtures. Area-specific fixtures live in each tests/<area>/conftest.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import poll_until

REPO = Path(__file__).resolve().parent.parent
# Subprocesses (the daemon, the FUSE sim) must import the same gpuguard whatever the
# working directory a test moves to: make a relative PYTHONPATH absolute once.
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in os.environ["PYTHONPATH"].split(os.pathsep) if p)
# The reference corpus comes from other projects: read it in place, never copy it in.
REFERENCE = Path(os.environ.get("GPUGUARD_REFERENCE", REPO.parent / "shared" / "reference"))


@pytest.fixture(scope="session")
def reference() -> Path:
    if not REFERENCE.is_dir():
        pytest.skip(f"reference corpus not found at {REFERENCE} (set GPUGUARD_REFERENCE)")
    return REFERENCE


def needs_root(reason: str):
    """Skip marker for tests that need root (kmsg writes, uevents, FUSE in CI)."""
    return pytest.mark.skipif(os.geteuid() != 0, reason=f"needs root: {reason}")


@pytest.fixture
def wait_for():
    return poll_until

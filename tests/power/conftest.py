"""The simulated host as a `SysfsRoot`, in process: every read and write goes through the
simulator's kernel-like file operations (`SimHost.read/write`, real errno), without a FUSE
mount — so these tests run anywhere, also without root."""
from __future__ import annotations

import pytest

from support import SimRoot


@pytest.fixture
def sim_root():
    return SimRoot

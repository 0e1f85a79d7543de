"""Fixtures for the simulator tests."""
from __future__ import annotations

import pytest

from gpuguard.sim.host import SimHost
from gpuguard.sim.topology import single_gpu_spec


@pytest.fixture
def single_gpu_host():
    """Factory: a one-card host shaped like a reference dump (see single_gpu_spec)."""
    def make(model, gpu_bus: int = 0x03, era: str = "6.14", root_speed: float = 16.0,
             root_width: int = 16, seed: int = 0) -> SimHost:
        return SimHost(single_gpu_spec(model, gpu_bus, era, root_speed, root_width), seed=seed)
    return make


@pytest.fixture
def incident():
    return SimHost.incident(seed=7)

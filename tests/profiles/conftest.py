import os

import pytest

from gpuguard.sim.host import SimHost

INCIDENT_R9700 = ("0000:05:00.0", "0000:08:00.0")
INCIDENT_XTX = ("0000:aa:00.0", "0000:b0:00.0")


def _fuse_usable() -> str | None:
    if os.geteuid() != 0:
        return "FUSE mount of the simulator needs root"
    from gpuguard.sim.fuse import fuse_available  # libfuse, /dev/fuse, fusermount3

    return fuse_available()


@pytest.fixture
def mount_sim(tmp_path):
    """mount_sim(host=None, overlay=None) -> a recording `SimMount` of `host` (the incident
    host by default) with the model's clock running and `/dev/kmsg` served as the simulated
    kernel log; unmounted at teardown."""
    why = _fuse_usable()
    if why:
        pytest.skip(why)
    from gpuguard.sim.fuse import SimMount
    from support import sim_extra

    made = []

    def make(host=None, overlay=None):
        host = host or SimHost.incident()
        d = tmp_path / f"sim{len(made)}"
        d.mkdir()
        m = SimMount(host, str(d), extra=sim_extra(host, overlay), record=True, tick=0.05)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()

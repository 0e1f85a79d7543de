import os

import pytest

from gpuguard.sim.host import SimHost

INCIDENT_R9700 = ("0000:05:00.0", "0000:08:00.0")
INCIDENT_XTX = ("0000:aa:00.0", "0000:b0:00.0")


def _simfs():
    import importlib.util
    import pathlib
    import sys

    if "profiles_simfs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("profiles_simfs", pathlib.Path(__file__).with_name("simfs.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["profiles_simfs"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["profiles_simfs"]


def _fuse_usable() -> str | None:
    if os.geteuid() != 0:
        return "FUSE mount of the simulator needs root"
    from gpuguard.sim.fuse import fuse_available  # libfuse, /dev/fuse, fusermount3

    return fuse_available()


@pytest.fixture
def mount_sim(tmp_path):
    """mount_sim(host=None, overlay=None) -> Mounted; unmounted at teardown."""
    why = _fuse_usable()
    if why:
        pytest.skip(why)
    Mounted = _simfs().Mounted

    made = []

    def make(host=None, overlay=None):
        host = host or SimHost.incident()
        d = tmp_path / f"sim{len(made)}"
        d.mkdir()
        m = Mounted(host, str(d), overlay)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()

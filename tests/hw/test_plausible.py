"""Issue 12 item 5: a sensor file holding an implausible value (temp1_input =
-99999999999999999999999999) is unreadable — absent from the snapshot, the scrape and
the flight recorder, with an error naming the file and the value — never −1e23 °C."""
from __future__ import annotations

import sqlite3

import httpx
import pytest
from service.failsafe_harness import GuardProcess, XTX, config_text, sim_root

from gpuguard.hw import plausible
from gpuguard.hw.amdgpu import discover_one, read_gpu
from gpuguard.hw.sysfs import SysfsRoot

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


# 20 digits, as many as a 64-bit attribute prints (longer is a format error already,
# tests/hw/test_amdgpu_files.py): a number the parser takes, a temperature no card has
GARBAGE = "-99999999999999999999\n"


@pytest.mark.parametrize("kind, value, ok", [
    ("temperature", 45.0, True), ("temperature", -1e23, False), ("temperature", 251.0, False),
    ("power", 320.5, True), ("power", -1.0, False), ("clock", 3.1e9, True), ("clock", 1e12, False),
    ("fan", 0.0, True), ("fan", 1e9, False), ("voltage", 0.9, True), ("voltage", 60.0, False),
    ("temperature", float("nan"), False), ("power", float("inf"), False),
])
def test_bounds_per_sensor_kind(kind, value, ok):
    if ok:
        assert plausible.check(kind, value, "f") == value
    else:
        with pytest.raises(ValueError, match=f"f: implausible {kind}"):
            plausible.check(kind, value, "f")


def _edge(root):
    return next(p for p in root.glob(f"sys/devices/**/{XTX}/hwmon/hwmon*/temp*_label") if p.read_text().strip() == "edge")


def test_read_gpu_drops_the_value_and_names_file_and_value(tmp_path):
    root = sim_root(tmp_path)
    edge_input = _edge(root).with_name(_edge(root).name.replace("_label", "_input"))
    edge_input.write_text(GARBAGE)
    sysfs = SysfsRoot(str(root))
    snap = read_gpu(sysfs, discover_one(sysfs, XTX), "xtx-0")
    assert "edge" not in snap.temperatures and "junction" in snap.temperatures
    err = snap.errors["temperature_edge"]
    assert edge_input.name in err and "implausible temperature -1e+17" in err
    assert snap.up  # one bad sensor is not a lost GPU


def test_daemon_neither_exports_nor_records_the_implausible_value(tmp_path, wait_for):
    wait = wait_for
    root = sim_root(tmp_path)
    edge_input = _edge(root).with_name(_edge(root).name.replace("_label", "_input"))
    edge_input.write_text(GARBAGE)
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(config_text(tmp_path / "state", tmp_path, None))
    d = GuardProcess(cfg, root)
    try:
        base = d.find_base(wait)
        gpu = httpx.get(base + "/v1/gpus/xtx-0", timeout=5).json()
        assert "implausible temperature" in gpu["errors"]["temperature_edge"]
        scrape = httpx.get(base + "/metrics", timeout=5).text
        temps = [l for l in scrape.splitlines() if l.startswith("gpuguard_gpu_temperature_celsius{") and 'gpu="xtx-0"' in l]
        assert temps and not any('sensor="edge"' in l for l in temps), temps
        assert "e+17" not in scrape and "e+16" not in scrape
        db = tmp_path / "flight.sqlite"
        rows = wait(lambda: sqlite3.connect(db).execute("SELECT edge_c, junction_c FROM samples WHERE gpu='xtx-0'").fetchall(),
                    what="recorded samples")
        assert all(e is None for e, _ in rows) and all(j is not None for _, j in rows), rows[:3]
    finally:
        assert d.stop() == 0


def test_screen_drops_implausible_values_of_any_source():
    """NVML has no file to name: the poller screens every snapshot with the same bounds."""
    import time

    from gpuguard.state.snapshot import GpuSnapshot

    s = GpuSnapshot(name="h200", bdf="0000:00:06.0", vendor="10de", device_id="2335", driver="nvidia", model="H200",
                    card=None, up=True, time=time.time(), power_watts=-5.0, power_cap_watts=700.0,
                    temperatures={"gpu": 1e23, "mem": 40.0}, clocks_hz={"sclk": 1.98e9}, fan_rpm=None)
    out = plausible.screen(s)
    assert out.power_watts is None and out.power_cap_watts == 700.0
    assert dict(out.temperatures) == {"mem": 40.0} and dict(out.clocks_hz) == {"sclk": 1.98e9}
    assert "implausible temperature 1e+23" in out.errors["temperature_gpu"] and "0000:00:06.0" in out.errors["temperature_gpu"]
    assert "implausible power -5.0" in out.errors["power_watts"]
    fine = plausible.screen(out)
    assert fine is out  # nothing left to drop

"""NVML telemetry replayed from a capture of a real NVIDIA H200 host (tests/fixtures/h200,
made with `python -m gpuguard.hw.nvml --capture`). NVML cannot run on CI machines; the
replay answers exactly what the real driver answered, errors included."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.hw.nvml import NvmlSource, RecordedNvml, normalise_bus_id

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "nvml-h200.json"


@pytest.fixture
def source() -> NvmlSource:
    return NvmlSource(RecordedNvml.load(str(FIXTURE)))


def test_bus_id_is_normalised_to_sysfs_form():
    assert normalise_bus_id("00000000:00:06.0") == "0000:00:06.0"
    assert normalise_bus_id(b"00000001:3B:00.0") == "0001:3b:00.0"


def test_discovers_the_h200_by_pci_address(source):
    (dev,) = source.discover()
    assert dev.bdf == "0000:00:06.0"
    assert (dev.vendor, dev.device_id) == ("10de", "2335")
    assert dev.model == "NVIDIA H200"


def test_reads_real_values_in_base_units(source):
    (dev,) = source.discover()
    snap = source.read(dev, "h200")
    assert snap.up
    assert snap.power_watts == pytest.approx(79.141)
    assert (snap.power_cap_watts, snap.power_cap_min_watts, snap.power_cap_max_watts) == (700.0, 200.0, 700.0)
    assert snap.temperatures == {"gpu": 39.0}
    assert snap.temperature_limits[("gpu", "crit")] == 89.0
    assert snap.clocks_hz["sclk"] == 345e6 and snap.clocks_hz["mclk"] == 3201e6
    assert snap.vram_total_bytes == 150754820096
    # BAR1 on the H200 (256 GiB) exceeds VRAM: large BAR is active.
    assert snap.vram_visible_bytes >= snap.vram_total_bytes
    assert snap.performance_level == "P0"


def test_replay_equals_what_the_real_host_read(source):
    """The capture also stored the snapshot gpuguard made on the real host."""
    real = json.loads(FIXTURE.read_text())["snapshots"][0]
    (dev,) = source.discover()
    replayed = source.read(dev, real["name"]).to_dict()
    for key in ("power_watts", "power_cap_watts", "temperatures_celsius", "clocks_hz", "vram_total_bytes",
                "vram_visible_bytes", "performance_level", "errors", "fan_rpm", "up"):
        assert replayed[key] == real[key], key


def test_fanless_card_has_no_fan_value_and_no_error(source):
    (dev,) = source.discover()
    snap = source.read(dev, "h200")
    assert snap.fan_rpm is None
    assert not any("fan" in k for k in snap.errors), snap.errors
    # the H200 said so itself: nvmlDeviceGetNumFans == 0
    calls = json.loads(FIXTURE.read_text())["calls"]
    assert {"call": "nvmlDeviceGetNumFans", "args": ["h"], "result": 0} in calls


def test_lost_gpu_is_down_with_the_reason():
    capture = json.loads(FIXTURE.read_text())
    for c in capture["calls"]:
        if c["call"] == "nvmlDeviceGetPowerUsage":
            c.pop("result", None)
            c["error"], c["message"] = "NVMLError_GpuIsLost", "GPU is lost"
    src = NvmlSource(RecordedNvml(capture))
    (dev,) = src.discover()
    snap = src.read(dev, "h200")
    assert not snap.up
    assert "GpuIsLost" in snap.errors["power_watts"]
    # the other values were still read, not zeroed
    assert snap.temperatures == {"gpu": 39.0}

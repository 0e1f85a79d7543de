"""NVML telemetry replayed from a capture of a real NVIDIA H200 host (tests/fixtures/h200,
made with `python -m gpuguard.hw.nvml --capture`). NVML cannot run on CI machines; the
replay answers exactly what the real driver answered, errors included."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.hw.nvml import NvmlSource, RecordedNvml

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "nvml-h200.json"
# NVML's v1 and v2 memory answers on the same H200 (driver 580.159.04), read on the real
# host next to `nvidia-smi --query-gpu=memory.used,memory.reserved` (nvidia-smi-memory.csv).
MEMORY = FIXTURE.with_name("nvml-memory-v1-v2.json")


def with_v2(capture: dict) -> dict:
    """The capture plus the real host's answer to nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2)."""
    mem = json.loads(MEMORY.read_text())
    v2 = mem["gpus"][0]["v2"]
    assert mem["driver"] == capture["driver_version"]  # the same host and driver
    capture = {**capture, "constants": {**capture["constants"], "nvmlMemory_v2": mem["nvmlMemory_v2"]}}
    capture["calls"] = [*capture["calls"], {"call": "nvmlDeviceGetMemoryInfo", "args": ["h", mem["nvmlMemory_v2"]],
                                            "result": {"__struct__": v2}}]
    return capture


@pytest.fixture
def source() -> NvmlSource:
    return NvmlSource(RecordedNvml(with_v2(json.loads(FIXTURE.read_text()))))


def test_vram_used_as_nvidia_smi_reports_it_and_the_reserve_apart(source):
    """Issue 14: v1's `used` counts the driver's reserve (615 MiB on an idle H200);
    nvidia-smi says 0 MiB used, 616 MiB reserved. gpuguard reads v2 and says the same."""
    (dev,) = source.discover()
    snap = source.read(dev, "h200")
    smi = FIXTURE.with_name("nvidia-smi-memory.csv").read_text().splitlines()[1]
    assert smi.startswith("0 MiB, 616 MiB")
    assert snap.vram_used_bytes == 0
    assert snap.vram_reserved_bytes == 644939776 and round(snap.vram_reserved_bytes / 2**20) == 615
    assert snap.vram_total_bytes == 150754820096 and "vram_reserved" not in snap.extra["nvml_unsupported"]
    assert snap.to_dict()["vram_reserved_bytes"] == 644939776


def test_without_nvml_v2_used_is_v1s_figure_and_the_reserve_is_named_unknown():
    src = NvmlSource(RecordedNvml.load(str(FIXTURE)))  # the capture alone: no v2 answer
    (dev,) = src.discover()
    snap = src.read(dev, "h200")
    assert snap.vram_used_bytes == 644939776 and snap.vram_reserved_bytes is None
    assert "includes the driver's reserve" in snap.extra["nvml_unsupported"]["vram_reserved"]
    assert "vram_reserved" not in snap.errors  # a missing v2 is not a poll error


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

"""The fast power sampler on NVIDIA, through the recorded-NVML replay: a capture of the
lent H200 under a bf16 matmul load (tests/fixtures/h200/nvml-h200-power.json) holding the
instantaneous power field (`nvmlDeviceGetFieldValues(NVML_FI_DEV_POWER_INSTANT)`) and the
averaged `nvmlDeviceGetPowerUsage`, 149 rounds each at 50 Hz. Reading only: every call the
sampler makes is a Get."""
from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest

from gpuguard.hw.nvml import NvmlSource, RecordedNvml
from gpuguard.hw.power_sampler import PowerSampler
from gpuguard.hw.power_sources import channel_for, nvml_channel
from support import poll_until

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "nvml-h200-power.json"


@pytest.fixture
def capture() -> dict:
    return json.loads(FIXTURE.read_text())


class CallLog:
    """RecordedNvml plus the names of the calls made through it."""

    def __init__(self, capture: dict) -> None:
        self.nvml = RecordedNvml(capture)
        self.calls: list[str] = []

    def __getattr__(self, attr):
        target = getattr(self.nvml, attr)
        if callable(target):
            def call(*args):
                self.calls.append(attr)
                return target(*args)
            return call
        return target


def device(nvml):
    (dev,) = NvmlSource(nvml).discover()
    return dev


def test_instant_field_is_chosen_and_read_in_watts(capture):
    nvml = RecordedNvml(capture)
    ch = nvml_channel(nvml, device(nvml), "h200")
    assert ch.source == "nvml_power_instant"
    assert "NVML_FI_DEV_POWER_INSTANT" in ch.where and "0000:00:06.0" in ch.where
    values = [ch.read() for _ in range(149)]
    assert 620 < min(values) and max(values) < 740            # 628–732 W as captured
    assert len(set(values)) > 10


def test_instant_field_shows_the_swings_the_averaged_call_hides(capture):
    """Same seconds on the same H200: the field swung 628–732 W, the averaged call
    689–694 W (the issue's measurement, reproduced from the capture)."""
    nvml = RecordedNvml(capture)
    dev = device(nvml)
    inst = nvml_channel(nvml, dev, "h200")
    h = nvml.nvmlDeviceGetHandleByIndex(dev.index)
    usage = [nvml.nvmlDeviceGetPowerUsage(h) / 1000 for _ in range(149)]
    values = [inst.read() for _ in range(149)]
    assert max(values) - min(values) > 80 > 10 > max(usage) - min(usage)
    assert statistics.mean(values) == pytest.approx(statistics.mean(usage), rel=0.03)


def test_sampler_thread_reads_the_field_and_only_reads(capture):
    log = CallLog(capture)
    src = NvmlSource(log)
    (dev,) = src.discover()
    ch = channel_for(src, dev, "h200")
    assert ch is not None and ch.source == "nvml_power_instant"
    sampler = PowerSampler(hz=50)
    try:
        sampler.sync([ch])
        poll_until(lambda: sampler.samplers["h200"].samples_total >= 40, timeout=30, what="40 NVML samples")
        w = sampler.take_windows()["h200"]
    finally:
        sampler.close()
    assert w.source == "nvml_power_instant" and w.errors == 0
    assert 620 < w.mean_w < w.p99_w <= w.peak_w < 740
    assert all(c.startswith(("nvmlDeviceGet", "nvmlSystemGet")) for c in log.calls), set(log.calls)


def test_falls_back_to_power_usage_when_the_field_is_not_supported(capture):
    cap = copy.deepcopy(capture)
    for c in cap["calls"]:
        if c["call"] == "nvmlDeviceGetFieldValues":
            c["result"][0]["__struct__"]["nvmlReturn"] = 3       # NVML_ERROR_NOT_SUPPORTED
    nvml = RecordedNvml(cap)
    ch = nvml_channel(nvml, device(nvml), "h200")
    assert ch.source == "nvml_power_usage"
    assert 685 < ch.read() < 700


def test_falls_back_when_the_driver_has_no_field_values_call(capture):
    cap = copy.deepcopy(capture)
    cap["calls"] = [c for c in cap["calls"] if c["call"] != "nvmlDeviceGetFieldValues"]
    nvml = RecordedNvml(cap)
    assert nvml_channel(nvml, device(nvml), "h200").source == "nvml_power_usage"


def test_lost_gpu_mid_sampling_is_an_error_naming_the_call_never_a_zero(capture):
    """The first field read (the channel's probe) answers; every later one says the GPU
    is lost: the windows then hold errors with NVML's own error name and no values."""
    fields = [c for c in capture["calls"] if c["call"] == "nvmlDeviceGetFieldValues"]
    for c in fields[1:]:
        c.pop("result")
        c["error"], c["message"] = "NVMLError_GpuIsLost", "GPU is lost"
    nvml = RecordedNvml(capture)
    ch = nvml_channel(nvml, device(nvml), "h200")
    assert ch.source == "nvml_power_instant"
    sampler = PowerSampler(hz=50)
    try:
        sampler.sync([ch])
        poll_until(lambda: sampler.samplers["h200"].errors_total >= 3, timeout=30, what="failed samples")
        w = sampler.take_windows()["h200"]
    finally:
        sampler.close()
    assert w.samples == 0 and w.peak_w is None and w.mean_w is None and w.p99_w is None
    assert w.errors >= 3 and "GPU is lost" in w.last_error


def test_capture_tool_measures_the_hardware_update_interval_from_the_replay(capture):
    """`python -m gpuguard.hw.nvml --capture-power` run against the replay of the H200: the
    values it reads change every ~104 ms (what the H200 refreshes), whatever the read rate."""
    from gpuguard.hw.nvml import sample_power

    nvml = RecordedNvml(capture)
    src = NvmlSource(nvml)
    out = sample_power(nvml, src.discover(), seconds=1.5, hz=200)["0000:00:06.0"]
    assert out["channel_source"] == "nvml_power_instant"
    assert 620 < out["instant_watts"]["min"] < out["instant_watts"]["max"] < 740
    assert 685 < out["usage_watts"]["min"] <= out["usage_watts"]["max"] < 700
    assert 60 < out["instant_update_interval_ms"] < 160

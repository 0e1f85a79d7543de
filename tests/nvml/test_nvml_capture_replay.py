"""The H200 capture of issue 18, replayed byte for byte: taken on a lent H200 with
`python -m gpuguard.hw.nvml_capture` (read-only: no setting touched), 5 samples idle,
one a second during a 30 s bf16 matmul loop (680 TFLOP/s), 3 after. The fixture is the
file the card's run wrote, unchanged; nvidia-smi's own view of the same minutes sits
beside it (nvidia-smi-q-idle.txt, nvidia-smi-q-load.txt) as the cross-check."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from gpuguard.hw.nvml import NvmlSource
from gpuguard.hw.nvml_replay import NvmlTimeline

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "h200"
CAPTURE = FIX / "nvml-capture.json"
# the file as it came back from the device run: a test that replays it byte for byte
CAPTURE_SHA256 = "72481cfbbd4dc3387f2192b16098f29947631623920cc796e7e6c0f235d1d469"


@pytest.fixture
def timeline() -> NvmlTimeline:
    return NvmlTimeline.load(str(CAPTURE))


def _reads(tl: NvmlTimeline, phase: str) -> list:
    src = NvmlSource(tl)
    (dev,) = src.discover()
    out = []
    for i in tl.indices(phase):
        tl.select(i)
        out.append(src.read(dev, "h200"))
    return out


def test_fixture_is_the_capture_unchanged():
    assert hashlib.sha256(CAPTURE.read_bytes()).hexdigest() == CAPTURE_SHA256


def test_capture_has_idle_load_and_after_phases(timeline):
    phases = [s["phase"] for s in timeline.samples]
    assert phases.count("idle") == 5 and phases.count("load") >= 25 and phases.count("after") == 3
    assert "680 TFLOP/s" in timeline.capture["load_log"]


def test_sw_power_cap_throttle_under_load_not_at_idle(timeline):
    idle = _reads(timeline, "idle")
    load = _reads(timeline, "load")
    assert all(s.extra["nvml"]["throttle"]["active"] == ["gpu_idle"] for s in idle)
    # the first load sample is taken while the clocks ramp; from then on the 700 W cap holds
    capped = [s for s in load if "sw_power_cap" in s.extra["nvml"]["throttle"]["active"]]
    assert len(capped) >= len(load) - 2
    assert all(s.power_watts > 600 for s in capped)
    # time in state grows with the cap; nvidia-smi said the same mid-load
    secs = [s.extra["nvml"]["throttle_seconds"]["sw_power_cap"] for s in capped]
    assert secs == sorted(secs) and secs[-1] - secs[0] > 20
    smi = (FIX / "nvidia-smi-q-load.txt").read_text()
    assert re.search(r"SW Power Cap\s+: Active", smi)


def test_memory_temperature_is_read_and_rises_under_load(timeline):
    idle = _reads(timeline, "idle")
    load = _reads(timeline, "load")
    assert all(30 <= s.temperatures["mem"] <= 40 for s in idle)
    assert max(s.temperatures["mem"] for s in load) >= 45
    assert idle[0].temperature_limits[("mem", "crit")] == 95.0
    smi = (FIX / "nvidia-smi-q-load.txt").read_text()
    smi_mem = int(re.search(r"Memory Current Temp\s+: (\d+) C", smi).group(1))
    assert min(s.temperatures["mem"] for s in load) <= smi_mem <= max(s.temperatures["mem"] for s in load)


def test_energy_counter_increases_and_matches_power(timeline):
    snaps = _reads(timeline, "idle") + _reads(timeline, "load") + _reads(timeline, "after")
    e = [s.extra["nvml"]["energy_joules"] for s in snaps]
    assert all(b >= a for a, b in zip(e, e[1:]))
    load = _reads(timeline, "load")[2:]
    t = [timeline.samples[i]["time"] for i in timeline.indices("load")][2:]
    joules = load[-1].extra["nvml"]["energy_joules"] - load[0].extra["nvml"]["energy_joules"]
    avg_watts = joules / (t[-1] - t[0])
    assert 600 < avg_watts < 720, avg_watts  # the 700 W cap, within the sampling jitter


def test_health_counters_and_absent_fields_with_reason(timeline):
    (s,) = _reads(timeline, "idle")[:1]
    h = s.extra["nvml"]
    assert h["ecc"] == {"enabled": 1, "corrected_volatile": 0, "uncorrected_volatile": 0,
                        "corrected_aggregate": 0, "uncorrected_aggregate": 0}
    assert h["row_remap"] == {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0}
    assert h["pcie"]["replays"] == 0 and (h["pcie"]["link_gen"], h["pcie"]["link_width"]) == (5, 16)
    # the H200 remaps rows instead of retiring pages and has no NVLink on this PCIe card:
    # absent with NVML's reason, and not a poll error
    assert "retired_pages" not in h and "nvlink" not in h
    assert s.extra["nvml_unsupported"]["field_retired_sbe"] == "NVMLError_NotSupported"
    assert s.extra["nvml_unsupported"]["nvlink"] == "NVMLError_NotSupported"
    assert s.errors == {}


def test_pcie_byte_counters_unwrap_and_grow(timeline):
    src = NvmlSource(timeline)  # one reader: the counters' state lives in it
    (dev,) = src.discover()
    snaps = []
    for i in range(len(timeline.samples)):
        timeline.select(i)
        snaps.append(src.read(dev, "h200"))
    tx = [s.extra["nvml"]["pcie"]["tx_bytes_total"] for s in snaps]
    assert tx == sorted(tx) and tx[-1] > tx[0]


def test_static_limits_are_read_once_not_every_poll(timeline):
    calls = []

    class Tap:
        def __getattr__(self, a):
            f = getattr(timeline, a)
            return (lambda *x: (calls.append(a), f(*x))[1]) if a.startswith("nvml") else f

    src = NvmlSource(Tap())
    (dev,) = src.discover()
    src.read(dev, "h200")
    calls.clear()
    src.read(dev, "h200")
    for static in ("nvmlDeviceGetBAR1MemoryInfo", "nvmlDeviceGetTemperatureThreshold",
                   "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlDeviceGetNvLinkState",
                   "nvmlDeviceGetPcieThroughput"):
        assert static not in calls
    assert calls.count("nvmlDeviceGetFieldValues") == 1


SHORT = FIX / "nvml-capture-short.json"  # a second run: 8 s of the same load, for processes
SHORT_SHA256 = "83f9797a31b29a32a46ab3db0a39aee89abf8ba03973a8089a0f35e3dc4c55d1"


def test_per_process_gpu_memory_under_load():
    assert hashlib.sha256(SHORT.read_bytes()).hexdigest() == SHORT_SHA256
    tl = NvmlTimeline.load(str(SHORT))
    idle = _reads(tl, "idle")
    load = _reads(tl, "load")
    assert all(s.extra["nvml"]["processes"] == [] for s in idle)
    # the matmul process: its pid and the memory NVML attributes to it (two 16384² bf16
    # operands, the result and the CUDA context)
    assert {p["pid"] for s in load for p in s.extra["nvml"]["processes"]} == {668}
    used = load[-1].extra["nvml"]["processes"][0]["vram_used_bytes"]
    assert used == 2795503616 and used < load[-1].vram_used_bytes


def test_the_event_watcher_ran_on_the_real_card():
    """What gpuguard's own watcher printed on the H200: it registered the critical types
    (65439 & EVENTS_WANTED) and the waits timed out quietly (no Xid on a healthy card)."""
    from gpuguard.hw import nvml_calls as C

    out = (FIX / "nvml-event-watcher.txt").read_text()
    assert f"open True {{'0000:00:06.0': {65439 & C.EVENTS_WANTED}}} {{}}" in out
    assert "waits [None, None, None, None]" in out

"""Field decoding details the H200 capture cannot show by itself: a 32-bit PCIe byte
counter wrapping, and a field failing with a code other than NotSupported."""
from __future__ import annotations

import json
from pathlib import Path

from gpuguard.hw import nvml_calls as C
from gpuguard.hw.nvml import NvmlSource
from gpuguard.hw.nvml_health import _unwrap
from gpuguard.hw.nvml_replay import NvmlTimeline

CAPTURE = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "nvml-capture.json"


def test_wrapping_counter_keeps_growing():
    state: dict = {}
    width = 1 << 32
    seq = [4_294_000_000, 4_294_967_000, 500, 1_500]  # wraps between the 2nd and 3rd read
    totals = [_unwrap(state, "pcie_tx_bytes", v, width) for v in seq]
    assert totals == [0, 967_000, 967_000 + 796, 967_000 + 796 + 1_000]


def _with_field(ret: int, field: str) -> NvmlTimeline:
    cap = json.loads(CAPTURE.read_text())
    s = cap["samples"][0]
    for c in s["calls"]:
        if c["call"] == "nvmlDeviceGetFieldValues":
            for fv in c["result"]:
                if fv["__struct__"]["fieldId"] == C.FIELDS[field]:
                    fv["__struct__"]["nvmlReturn"] = ret
    return NvmlTimeline(cap)


def test_a_field_failing_otherwise_is_an_error_naming_it_and_the_rest_still_read():
    tl = _with_field(15, "memory_temp")  # 15 = NVML_ERROR_GPU_IS_LOST per field
    src = NvmlSource(tl)
    (dev,) = src.discover()
    snap = src.read(dev, "h200")
    assert "mem" not in snap.temperatures
    assert snap.errors["field_memory_temp"] == "NVML field memory_temp (82): return code 15"
    assert snap.extra["nvml"]["energy_joules"] > 0  # the other fields of the same call


def test_not_supported_field_is_absent_not_an_error():
    tl = _with_field(3, "energy_mj")
    src = NvmlSource(tl)
    (dev,) = src.discover()
    snap = src.read(dev, "h200")
    assert "energy_joules" not in snap.extra["nvml"]
    assert snap.extra["nvml_unsupported"]["field_energy_mj"] == "NVMLError_NotSupported"
    assert snap.errors == {}

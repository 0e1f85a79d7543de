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


# -- what the lent H200 had nothing of: the same capture, doctored in memory ----------------
# The H200 ran no video work, is PCIe-only (NotSupported on every NVLink) and remaps rows
# instead of retiring pages. Each test below changes only the answers that would differ on
# a card that has them, in NVML's own shapes; the recorded file is left as it is.


def _capture() -> dict:
    return json.loads(CAPTURE.read_text())


def _fields(cap: dict):
    for s in cap["samples"]:
        for c in s["calls"]:
            if c["call"] == "nvmlDeviceGetFieldValues":
                for fv in c["result"]:
                    yield fv["__struct__"]


def _set_field(cap: dict, field: str, value: int, member: str) -> None:
    for st in _fields(cap):
        if st["fieldId"] == C.FIELDS[field]:
            st["nvmlReturn"] = 0
            st["value"]["__struct__"][member] = value


def _scrape(snap) -> str:
    import time as _time

    from gpuguard.sinks.metrics import MetricsSink
    from gpuguard.state.hub import HostSnapshot, Hub

    hub = Hub()
    hub.publish_snapshot(HostSnapshot(time=_time.time(), gpus=(snap,)))
    return MetricsSink(hub).render().decode()


def _read(cap: dict):
    src = NvmlSource(NvmlTimeline(cap))
    (dev,) = src.discover()
    return src.read(dev, "h200")


def test_present_encoder_and_decoder_utilisation():
    cap = _capture()
    for s in cap["samples"]:
        for c in s["calls"]:
            # (utilisation %, sampling period µs), as nvmlDeviceGetEncoderUtilization answers
            if c["call"] == "nvmlDeviceGetEncoderUtilization":
                c["result"] = [37, 167000]
            elif c["call"] == "nvmlDeviceGetDecoderUtilization":
                c["result"] = [12, 167000]
    snap = _read(cap)
    assert snap.extra["nvml"]["encoder_busy_ratio"] == 0.37
    assert snap.extra["nvml"]["decoder_busy_ratio"] == 0.12
    text = _scrape(snap)
    assert 'gpuguard_gpu_encoder_busy_ratio{gpu="h200"} 0.37' in text
    assert 'gpuguard_gpu_decoder_busy_ratio{gpu="h200"} 0.12' in text


def test_present_nvlink_links_with_one_down():
    cap = _capture()
    _set_field(cap, "nvlink_link_count", 4, "uiVal")
    state = {0: 1, 1: 1, 2: 1, 3: 0}  # NVML_FEATURE_ENABLED / DISABLED per link
    asked = []
    for c in cap["discovery"]:
        if c["call"] == "nvmlDeviceGetNvLinkState" and c["args"][1] in state:
            c.pop("error"), c.pop("message")
            c["result"] = state[c["args"][1]]
            asked.append(c["args"][1])
    assert asked == [0, 1, 2, 3]
    snap = _read(cap)
    assert snap.extra["nvml"]["nvlink"] == {"0": True, "1": True, "2": True, "3": False}
    assert "nvlink" not in snap.extra["nvml_unsupported"] and snap.errors == {}
    text = _scrape(snap)
    assert 'gpuguard_gpu_nvlink_up{gpu="h200",link="2"} 1.0' in text
    assert 'gpuguard_gpu_nvlink_up{gpu="h200",link="3"} 0.0' in text
    assert 'link="4"' not in text  # only the links the card says it has are asked


def test_present_retired_pages_and_pending_retirement():
    cap = _capture()
    _set_field(cap, "retired_sbe", 2, "ullVal")
    _set_field(cap, "retired_dbe", 1, "ullVal")
    _set_field(cap, "retired_pending", 1, "ullVal")
    snap = _read(cap)
    assert snap.extra["nvml"]["retired_pages"] == {"sbe": 2, "dbe": 1, "pending": 1}
    assert not {"field_retired_sbe", "field_retired_dbe", "field_retired_pending"} & set(snap.extra["nvml_unsupported"])
    text = _scrape(snap)
    assert 'gpuguard_gpu_retired_pages{cause="sbe",gpu="h200"} 2.0' in text
    assert 'gpuguard_gpu_retired_pages{cause="dbe",gpu="h200"} 1.0' in text
    assert 'gpuguard_gpu_retired_pages_pending{gpu="h200"} 1.0' in text


def test_the_recorded_h200_itself_has_none_of_them():
    snap = _read(_capture())
    h = snap.extra["nvml"]
    assert h["encoder_busy_ratio"] == 0.0 and "nvlink" not in h and "retired_pages" not in h
    assert snap.extra["nvml_unsupported"]["nvlink"] == "NVMLError_NotSupported"

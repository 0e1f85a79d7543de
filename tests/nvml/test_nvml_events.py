"""Xid and other critical events from NVML's event set, beside the kernel log's Xid rule:
same kinds, same policy, one Xid seen by both sources counted once (issue 18).

The event set is the H200's as captured (its supported-types mask, its registration, the
clock-change events it delivered under load); an Xid is added in the very shape the card
delivered its events in (nvmlEventData_t), since no Xid can be provoked on a lent card."""
from __future__ import annotations

import asyncio
import copy
import json
import time
from pathlib import Path

import pytest

from gpuguard.hw import nvml_calls as C
from gpuguard.hw.nvml import NvmlSource
from gpuguard.hw.nvml_events import CRITICAL_XIDS, NvmlEventWatcher, events_for, run_watcher
from gpuguard.hw.nvml_replay import NvmlTimeline
from gpuguard.kernel.kmsg import parse_record
from gpuguard.kernel.router import KernelEventRouter
from gpuguard.kernel.rules import Rules

CAPTURE = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "nvml-capture.json"
BDF = "0000:00:06.0"  # the H200's address in the capture


def h200_states():
    """The GPU state owner with the H200 discovered: loss and counters are kept there."""
    from types import SimpleNamespace

    from gpuguard.state.gpus import GpuStates

    s = GpuStates()
    s.observe([SimpleNamespace(bdf=BDF, vendor="10de", device_id="2335", model="H200")])
    return s
_seq = iter(range(1, 10**9))


def kernel(text: str):
    return parse_record(f"4,{next(_seq)},{int(time.monotonic() * 1e6)},-;{text}\n".encode())


def registering_critical_types(cap: dict) -> dict:
    """The capture registered every supported type (65439); gpuguard registers the
    critical subset. NVML answers a subset exactly as it answered the whole (success,
    no data), so the card's own answer is reused for the subset's arguments."""
    real = next(c for c in cap["discovery"] if c["call"] == "nvmlDeviceRegisterEvents")
    sub = copy.deepcopy(real)
    sub["args"][1] = real["args"][1] & C.EVENTS_WANTED
    cap["discovery"].append(sub)
    return cap


def h200() -> NvmlTimeline:
    return NvmlTimeline(registering_critical_types(json.loads(CAPTURE.read_text())))


def with_xid(xid: int, after_clock_events: int = 3) -> NvmlTimeline:
    """The capture's event stream with one Xid spliced in, shaped as the card's own."""
    cap = registering_critical_types(json.loads(CAPTURE.read_text()))
    real = next(e for e in cap["events"] if "result" in e)
    xid_event = copy.deepcopy(real)
    xid_event["result"]["__struct__"].update(eventType=C.EVENT_XID, eventData=xid)
    cap["events"] = cap["events"][:after_clock_events] + [xid_event]
    return NvmlTimeline(cap)


class Hooks:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_alert(self, e):
        self.calls.append(("alert", e.kind, e.bdf))

    def on_gpu_lost(self, bdf):
        self.calls.append(("lost", bdf))

    def on_gpu_fatal(self, bdf, kind):
        self.calls.append(("fatal", bdf, kind))


@pytest.fixture(scope="module")
def rules() -> Rules:
    return Rules.load()


def test_critical_xids_are_the_kernel_rules_list():
    assert 79 in CRITICAL_XIDS and 48 in CRITICAL_XIDS and 13 not in CRITICAL_XIDS


def test_event_data_to_events():
    class D:
        def __init__(self, t, d):
            self.eventType, self.eventData = t, d

    lost = events_for(D(C.EVENT_XID, 79), BDF, "h200")
    assert [(e.kind, e.severity) for e in lost] == [("nvidia_xid", "critical"), ("device_lost", "critical")]
    assert lost[0].fields["xid"] == 79 and lost[0].source == "nvml"
    assert [(e.kind, e.severity) for e in events_for(D(C.EVENT_XID, 13), BDF, "h200")] == [("nvidia_xid", "alert")]
    assert [e.kind for e in events_for(D(C.EVENT_DBE, 0), BDF, None)] == ["nvidia_ecc_uncorrected"]
    assert events_for(D(C.EVENT_CLOCK, 0), BDF, None) == []  # clock changes are not news


def test_watcher_registers_only_critical_types_on_the_h200():
    tl = h200()
    w = NvmlEventWatcher(tl, NvmlSource(tl).discover())
    assert w.open()
    supported = 65439  # what the H200 answered to nvmlDeviceGetSupportedEventTypes
    assert w.registered == {BDF: supported & C.EVENTS_WANTED}
    assert w.registered[BDF] & C.EVENT_XID and not w.registered[BDF] & C.EVENT_CLOCK
    # what the card delivered under load were clock changes: none becomes an event
    for _ in range(20):
        data = w.wait_once()
        assert data is not None and events_for(data, BDF, "h200") == []


def _run(tl: NvmlTimeline, router: KernelEventRouter, until) -> None:
    async def main():
        stop = asyncio.Event()
        w = NvmlEventWatcher(tl, NvmlSource(tl).discover(), wait_ms=10)
        task = asyncio.create_task(run_watcher(w, router.handle_external, lambda b: "h200", stop))
        deadline = time.monotonic() + 30
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_nvml_xid_79_marks_the_gpu_lost_through_the_kernel_policy(rules):
    hooks = Hooks()
    router = KernelEventRouter(rules, {BDF: "h200"}.get, hooks, states=h200_states())
    _run(with_xid(79), router, lambda: router.is_lost(BDF))
    assert router.is_lost(BDF)
    assert ("lost", BDF) in hooks.calls and ("fatal", BDF, "device_lost") in hooks.calls
    assert router.counts[("h200", "nvidia_xid")] == 1
    xid = next(e for e in router.events if e.kind == "nvidia_xid")
    assert xid.source == "nvml" and xid.fields["xid"] == 79 and xid.severity == "critical"


def test_one_xid_from_both_sources_counts_once(rules):
    hooks = Hooks()
    router = KernelEventRouter(rules, {BDF: "h200"}.get, hooks, states=h200_states())
    # NVML first, then the kernel's own lines for the same loss
    _run(with_xid(79), router, lambda: router.is_lost(BDF))
    assert router.handle_record(kernel("NVRM: Xid (PCI:0000:00:06): 79, pid=0, GPU has fallen off the bus.")) is None
    assert router.handle_record(kernel("NVRM: GPU 0000:00:06.0: GPU has fallen off the bus.")) is None
    assert router.counts[("h200", "nvidia_xid")] == 1
    assert router.counts[("h200", "device_lost")] == 1
    assert hooks.calls.count(("lost", BDF)) == 1

    # the other order: kernel first, NVML's report of the same Xid is dropped
    router2 = KernelEventRouter(rules, {BDF: "h200"}.get, Hooks(), states=h200_states())
    assert router2.handle_record(kernel("NVRM: Xid (PCI:0000:00:06): 13, pid=1, Graphics Exception")) is not None
    tl = with_xid(13, after_clock_events=0)
    _run(tl, router2, lambda: tl._event_pos >= 1)  # the Xid was taken (and dropped)
    assert router2.counts[("h200", "nvidia_xid")] == 1
    # a different Xid on the same card is news
    other = events_for(type("D", (), {"eventType": C.EVENT_XID, "eventData": 31})(), BDF, "h200")[0]
    assert router2.handle_external(other) is other


def test_start_wires_an_nvml_source_into_the_router_it_is_given(rules):
    """The daemon's wiring (`nvml_events.start`) gets the sources, the router's handler and
    the name lookup, not the daemon: an Xid 79 from NVML marks the GPU lost."""
    from gpuguard.hw import nvml_events

    router = KernelEventRouter(rules, {BDF: "h200"}.get, Hooks(), states=h200_states())
    tl = with_xid(79)

    async def main():
        stop = asyncio.Event()
        assert nvml_events.start([], router.handle_external, lambda b: "h200", stop) is None  # no NVML source
        assert nvml_events.start([NvmlSource(tl)], None, lambda b: "h200", stop) is None  # no kernel router
        task = nvml_events.start([NvmlSource(tl)], router.handle_external, {BDF: "h200"}.get, stop)
        assert task is not None and task.get_name() == "nvml-events"
        deadline = time.monotonic() + 30
        while not router.is_lost(BDF) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert router.is_lost(BDF) and router.counts[("h200", "nvidia_xid")] == 1

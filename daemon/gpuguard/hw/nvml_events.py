"""Xid and other critical events from NVML's event set (`nvmlEventSetWait`), beside the
kernel log's `NVRM: Xid` rule: the same event kinds (`nvidia_xid` with the same critical
Xid list as kernel/rules.yaml, `device_lost`) and so the same policy. The router drops
the second sighting of one Xid when both sources report it (KernelEventRouter.handle_external).

NVML reports an Xid as eventType=XidCriticalError with the Xid number in eventData.
Xid 79 is "GPU has fallen off the bus": the card is gone, so it is also `device_lost`
(mark lost, kill its engines), as the kernel's "fallen off the bus" line is.

Registered only for the critical types (EVENTS_WANTED): the lent H200 delivered 1302
clock-change events in 50 s of a load when every type was registered (the capture).
"""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Callable, Iterable

from gpuguard.hw import nvml_calls as C
from gpuguard.state.events import Event

log = logging.getLogger("gpuguard.nvml")

XID_DEVICE_LOST = 79


def _critical_xids() -> frozenset[int]:
    """The Xids rules.yaml calls critical, read from the rule itself so the two sources
    can never disagree on severity."""
    from importlib import resources

    text = resources.files("gpuguard.kernel").joinpath("rules.yaml").read_text()
    m = re.search(r"\(\?P<xid>((?:\d+\|)+\d+)\)", text)
    return frozenset(int(x) for x in m.group(1).split("|")) if m else frozenset({XID_DEVICE_LOST})


CRITICAL_XIDS = _critical_xids()


def events_for(data: Any, bdf: str | None, gpu: str | None) -> list[Event]:
    """One nvmlEventData_t -> the events gpuguard reports (possibly none)."""
    etype = int(data.eventType)
    edata = int(data.eventData)
    common = {"gpu": gpu, "bdf": bdf, "source": "nvml"}
    if etype & C.EVENT_XID:
        sev = "critical" if edata in CRITICAL_XIDS else "alert"
        out = [Event(kind="nvidia_xid", severity=sev, message=f"NVML: Xid {edata} on {bdf}",
                     fields={"xid": edata, "event_type": etype}, **common)]
        if edata == XID_DEVICE_LOST:
            out.append(Event(kind="device_lost", severity="critical",
                             message=f"NVML: Xid 79, GPU {bdf} has fallen off the bus",
                             fields={"xid": edata, "condition": True}, **common))
        return out
    if etype & C.EVENT_GPU_UNAVAILABLE:
        return [Event(kind="device_lost", severity="critical", message=f"NVML: GPU {bdf} unavailable",
                      fields={"event_type": etype, "condition": True}, **common)]
    if etype & C.EVENT_DBE:
        return [Event(kind="nvidia_ecc_uncorrected", severity="critical",
                      message=f"NVML: uncorrectable (double-bit) ECC error on {bdf}",
                      fields={"event_type": etype}, **common)]
    if etype & C.EVENT_SBE:
        return [Event(kind="nvidia_ecc_corrected", severity="info",
                      message=f"NVML: corrected ECC error on {bdf}", fields={"event_type": etype}, **common)]
    return []


def _addr(p: Any) -> Any:
    """A device handle's identity: ctypes pointers compare by object, not address."""
    try:
        import ctypes

        return ctypes.cast(p, ctypes.c_void_p).value
    except Exception:
        return id(p)


class NvmlEventWatcher:
    """Blocking part: an event set over every device, waited on in short slices so a stop
    is noticed within `wait_ms`."""

    def __init__(self, nvml: Any, devices: Iterable[Any], wait_ms: int = 500) -> None:
        self.nvml = nvml
        self.devices = list(devices)
        self.wait_ms = wait_ms
        self.evset: Any = None
        self.registered: dict[str, int] = {}  # bdf -> registered mask
        self.unsupported: dict[str, str] = {}  # bdf -> NVML's reason
        self._by_handle: list[tuple[Any, Any]] = []

    def open(self) -> bool:
        n = self.nvml
        try:
            self.evset = n.nvmlEventSetCreate()
        except Exception as e:  # no event support at all (old driver, some VMs)
            log.warning("NVML events not watched: nvmlEventSetCreate: %s: %s", type(e).__name__, e)
            return False
        for d in self.devices:
            try:
                h = n.nvmlDeviceGetHandleByIndex(d.index)
                supported = int(n.nvmlDeviceGetSupportedEventTypes(h))
                mask = supported & C.EVENTS_WANTED
                if not mask:
                    self.unsupported[d.bdf] = "no critical event type supported"
                    continue
                n.nvmlDeviceRegisterEvents(h, mask, self.evset)
                self.registered[d.bdf] = mask
                self._by_handle.append((h, d))
            except Exception as e:
                self.unsupported[d.bdf] = f"{type(e).__name__}: {e}"
                log.warning("NVML events for %s not watched: %s: %s", d.bdf, type(e).__name__, e)
        return bool(self.registered)

    def wait_once(self) -> Any | None:
        """One event's data, or None after wait_ms without one."""
        try:
            return self.nvml.nvmlEventSetWait_v2(self.evset, self.wait_ms)
        except Exception as e:
            if type(e).__name__ == "NVMLError_Timeout":
                return None
            raise

    def device_of(self, data: Any) -> Any | None:
        if len(self._by_handle) == 1:
            return self._by_handle[0][1]
        for h, d in self._by_handle:
            if _addr(data.device) == _addr(h):
                return d
        return None

    def close(self) -> None:
        if self.evset is not None:
            try:
                self.nvml.nvmlEventSetFree(self.evset)
            except Exception:
                pass
            self.evset = None


async def run_watcher(watcher: NvmlEventWatcher, emit: Callable[[Event], object],
                      name_for_bdf: Callable[[str], str | None], stop: asyncio.Event) -> None:
    """Feed NVML's events to `emit` (the kernel router's handle_external) until `stop`."""
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, watcher.open):
        return
    errors = 0
    free = True
    try:
        while not stop.is_set():
            try:
                data = await loop.run_in_executor(None, watcher.wait_once)
            except Exception as e:
                errors += 1
                log.error("NVML event wait failed (%d): %s: %s", errors, type(e).__name__, e)
                if errors >= 5:
                    log.error("NVML events no longer watched after 5 failures; the kernel log still is")
                    return
                await asyncio.sleep(1.0)
                continue
            if data is None:
                continue
            dev = watcher.device_of(data)
            bdf = dev.bdf if dev is not None else None
            for ev in events_for(data, bdf, name_for_bdf(bdf) if bdf else None):
                emit(ev)
    except asyncio.CancelledError:
        # cancelled while a worker thread may still sit in nvmlEventSetWait: freeing the
        # set under it is undefined in NVML; the process is stopping, the driver frees it
        free = False
        raise
    finally:
        if free:
            watcher.close()


def start(sources: Iterable[Any], handle: Callable[..., Any] | None, gpu_name: Callable[[str], str | None],
          stop: asyncio.Event) -> asyncio.Task | None:
    """When an NVML source polls GPUs and the kernel router runs (`handle`: its
    `handle_external`), watch NVML's events into that router. Returns the task, or None."""
    src = next((s for s in sources if getattr(s, "name", "") == "nvml"), None)
    if handle is None or src is None:
        return None
    try:
        devices = src.discover()
    except Exception as e:
        log.warning("NVML events not watched: discovery failed: %s", e)
        return None
    watcher = NvmlEventWatcher(src.nvml, devices)
    return asyncio.create_task(run_watcher(watcher, handle, gpu_name, stop), name="nvml-events")

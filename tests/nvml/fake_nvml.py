"""A fake NVML *writer* for the profile tests — tests only, never a real card.

Each card starts from the H200's own answers in the capture (its power-limit constraints
200-700 W, default 700 W, supported memory clocks 3201/2201 MHz and graphics clocks
345-1980 MHz) and enforces NVML's rules as nvml.h documents them:
  * every Set*/Reset* needs root: NVMLError_NoPermission otherwise;
  * a power limit outside nvmlDeviceGetPowerManagementLimitConstraints:
    NVMLError_InvalidArgument; min > max for locked clocks: InvalidArgument;
  * a card/driver without the feature (a VM, a consumer card): NVMLError_NotSupported;
  * the enforced limit is the lowest of all limits: an `external_limit_mw` (a host or
    board cap) makes a higher set limit read back lower;
  * locked clocks hold the graphics clock inside the range unless a power cap pulls it
    below (then the SW power cap reason is set), as the H200 showed under load;
  * a card can appear late (device count grows after `appears_after` count calls) and
    can be lost (GpuIsLost on every call);
  * a card can refuse this caller even as root (`no_permission`: a vGPU or passthrough
    card whose hypervisor forbids clock and power changes answers NoPermission);
  * a GPU reset (`reset_gpu`, what `nvidia-smi -r` or a recovery does) puts the default
    power limit back and drops the locked clocks, silently.
Every write is logged in `writes` as (card index, call, args) so tests can check order.

With `telemetry` (an NvmlTimeline of the recorded H200) the calls this fake does not
model (temperatures, utilisation, field values, events) answer as the real card did, so
the daemon's NVML poller can read the fake like a host; what the fake models (limits,
clocks, clock-event reasons, the enforced limit) answers from the fake's own state.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CAPTURE = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "nvml-capture.json"


def _h200() -> dict:
    cap = json.loads(CAPTURE.read_text())
    d = {(c["call"], tuple(c["args"][1:])): c.get("result") for c in cap["discovery"]}
    mem = d[("nvmlDeviceGetSupportedMemoryClocks", ())]
    return {
        "constraints": tuple(d[("nvmlDeviceGetPowerManagementLimitConstraints", ())]),
        "default_mw": d[("nvmlDeviceGetPowerManagementDefaultLimit", ())],
        "memory_clocks": tuple(mem),
        "graphics_clocks": tuple(d[("nvmlDeviceGetSupportedGraphicsClocks", (max(mem),))]),
    }


H200 = _h200()


class NVMLError(Exception):
    pass


def _err(name: str) -> type:
    return type(name, (NVMLError,), {})


NVMLError_NoPermission = _err("NVMLError_NoPermission")
NVMLError_NotSupported = _err("NVMLError_NotSupported")
NVMLError_InvalidArgument = _err("NVMLError_InvalidArgument")
NVMLError_GpuIsLost = _err("NVMLError_GpuIsLost")


@dataclass
class FakeCard:
    bdf: str
    uuid: str
    supports_power: bool = True
    supports_locked_clocks: bool = True
    external_limit_mw: int | None = None  # another limit holding the enforced one lower
    loaded: bool = False  # under load the 700 W cap pulls the graphics clock down
    lost: bool = False
    no_permission: bool = False  # the driver refuses this caller on this card
    limit_mw: int = H200["default_mw"]
    gpu_locked: tuple[int, int] | None = None
    mem_locked: tuple[int, int] | None = None
    log: list = field(default_factory=list)


class FakeNvml:
    def __init__(self, cards: list[FakeCard], root: bool = True, appears_after: dict[int, int] | None = None,
                 telemetry: Any = None) -> None:
        self.cards = cards
        self.telemetry = telemetry
        self.root = root
        self.appears_after = appears_after or {}  # card index -> count calls before it shows
        self.count_calls = 0
        self.writes: list[tuple[int, str, tuple]] = []
        for name in ("NVMLError_NoPermission", "NVMLError_NotSupported", "NVMLError_InvalidArgument",
                     "NVMLError_GpuIsLost"):
            setattr(self, name, globals()[name])

    def __getattr__(self, attr: str) -> Any:
        telemetry = self.__dict__.get("telemetry")
        if telemetry is None or not attr.startswith("nvml"):
            raise AttributeError(attr)
        answer = getattr(telemetry, attr)

        def call(*args: Any) -> Any:
            if args and isinstance(args[0], int):  # a device handle of this fake
                self._card(args[0])  # a lost card answers nothing
                args = (object(), *args[1:])  # the recording keys device handles as "h"
            return answer(*args)

        return call

    def reset_gpu(self, h: int) -> None:
        """A GPU reset: the driver's defaults again (nothing is logged as a write)."""
        c = self.cards[h]
        c.limit_mw, c.gpu_locked, c.mem_locked = H200["default_mw"], None, None

    def writes_of(self, h: int) -> list[str]:
        """The calls written to one card, in order, as `call(args)`."""
        return [f"{call}({', '.join(map(str, args))})" for i, call, args in self.writes if i == h]

    # -- discovery ------------------------------------------------------------------------
    def _visible(self) -> list[int]:
        return [i for i in range(len(self.cards)) if self.count_calls >= self.appears_after.get(i, 0)]

    def nvmlDeviceGetCount(self) -> int:
        self.count_calls += 1
        return len(self._visible())

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        vis = self._visible()
        if i >= len(vis):
            raise NVMLError_InvalidArgument("Invalid Argument")
        return vis[i]  # the handle is the card's slot

    def _card(self, h: int) -> FakeCard:
        c = self.cards[h]
        if c.lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return c

    def nvmlDeviceGetPciInfo(self, h):
        c = self._card(h)
        return type("Pci", (), {"busId": "0000" + c.bdf.upper(), "pciDeviceId": 0x233510DE})()

    def nvmlDeviceGetName(self, h):
        self._card(h)
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return self._card(h).uuid

    # -- reads ----------------------------------------------------------------------------
    def nvmlDeviceGetPowerManagementLimitConstraints(self, h):
        if not self._card(h).supports_power:
            raise NVMLError_NotSupported("Not Supported")
        return list(H200["constraints"])

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h):
        if not self._card(h).supports_power:
            raise NVMLError_NotSupported("Not Supported")
        return H200["default_mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        c = self._card(h)
        return min(c.limit_mw, c.external_limit_mw or c.limit_mw)

    def nvmlDeviceGetSupportedMemoryClocks(self, h):
        self._card(h)
        return list(H200["memory_clocks"])

    def nvmlDeviceGetSupportedGraphicsClocks(self, h, mem):
        self._card(h)
        if mem not in H200["memory_clocks"]:
            raise NVMLError_InvalidArgument("Invalid Argument")
        return list(H200["graphics_clocks"])

    def nvmlDeviceGetClockInfo(self, h, clock):
        c = self._card(h)
        if clock == 2:  # memory
            return c.mem_locked[1] if c.mem_locked else max(H200["memory_clocks"])
        lo, hi = c.gpu_locked or (min(H200["graphics_clocks"]), max(H200["graphics_clocks"]))
        if c.loaded:
            return min(hi, 1440)  # the H200 under its 700 W cap ran 1425-1470 MHz (the capture)
        return hi if c.gpu_locked else 345

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        c = self._card(h)
        if c.loaded:
            return 0x4  # SW power cap, as the H200 reported under load
        return 0x0 if c.gpu_locked else 0x1

    # -- writes (NVML's rules) --------------------------------------------------------------
    def _write(self, h: int, call: str, args: tuple) -> FakeCard:
        c = self._card(h)
        if not self.root or c.no_permission:
            raise NVMLError_NoPermission("Insufficient Permissions")
        self.writes.append((h, call, args))
        return c

    def nvmlDeviceSetPowerManagementLimit(self, h, mw):
        c = self._write(h, "nvmlDeviceSetPowerManagementLimit", (mw,))
        if not c.supports_power:
            raise NVMLError_NotSupported("Not Supported")
        lo, hi = H200["constraints"]
        if not lo <= mw <= hi:
            raise NVMLError_InvalidArgument("Invalid Argument")
        c.limit_mw = mw

    def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
        c = self._write(h, "nvmlDeviceSetGpuLockedClocks", (lo, hi))
        if not c.supports_locked_clocks:
            raise NVMLError_NotSupported("Not Supported")
        if lo > hi:
            raise NVMLError_InvalidArgument("Invalid Argument")
        c.gpu_locked = (lo, hi)

    def nvmlDeviceSetMemoryLockedClocks(self, h, lo, hi):
        c = self._write(h, "nvmlDeviceSetMemoryLockedClocks", (lo, hi))
        if not c.supports_locked_clocks:
            raise NVMLError_NotSupported("Not Supported")
        if lo > hi:
            raise NVMLError_InvalidArgument("Invalid Argument")
        c.mem_locked = (lo, hi)

    def nvmlDeviceResetGpuLockedClocks(self, h):
        c = self._write(h, "nvmlDeviceResetGpuLockedClocks", ())
        if not c.supports_locked_clocks:
            raise NVMLError_NotSupported("Not Supported")
        c.gpu_locked = None

    def nvmlDeviceResetMemoryLockedClocks(self, h):
        c = self._write(h, "nvmlDeviceResetMemoryLockedClocks", ())
        if not c.supports_locked_clocks:
            raise NVMLError_NotSupported("Not Supported")
        c.mem_locked = None

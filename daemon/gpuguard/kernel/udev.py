"""udev device events for GPUs (subsystems drm and pci), on the asyncio loop: owns the
netlink monitor (pyudev) and turning its devices into `DeviceEvent`s with a PCI address.

The address comes from the device path, which a `remove` still carries when sysfs no
longer has the device. Without a running udevd (containers, minimal guests) the kernel's
own uevents are read (`source="kernel"`); with udevd, its processed events.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from gpuguard.hw.pci_address import bdf_in_path

log = logging.getLogger(__name__)

_DRM_CARD = re.compile(r"^card\d+$")


class UdevError(RuntimeError):
    """The udev monitor cannot be started."""


@dataclass(frozen=True)
class DeviceEvent:
    """One uevent. Unpacks as `(action, bdf, subsystem, sys_path)`."""

    action: str
    bdf: str | None
    subsystem: str
    sys_path: str
    sys_name: str = ""
    pci_class: int | None = None

    def __iter__(self) -> Iterator[str | None]:
        return iter((self.action, self.bdf, self.subsystem, self.sys_path))

    @property
    def is_drm_card(self) -> bool:
        """`card0` is the GPU; `renderD128` and connectors (`card0-DP-1`) are not."""
        return self.subsystem == "drm" and bool(_DRM_CARD.match(self.sys_name))


def bdf_from_devpath(devpath: str) -> str | None:
    """The deepest PCI address in a device path (`…/0000:03:00.0/drm/card0` → 0000:03:00.0)."""
    return bdf_in_path(devpath)


def device_event(device: object) -> DeviceEvent:
    """A DeviceEvent from a pyudev Device."""
    props = getattr(device, "properties", {})
    devpath = props.get("DEVPATH") or getattr(device, "device_path", "") or ""
    sys_path = getattr(device, "sys_path", "") or devpath
    pci_class = None
    raw_class = props.get("PCI_CLASS")
    if raw_class:
        try:
            pci_class = int(raw_class, 16)
        except ValueError:
            pci_class = None
    return DeviceEvent(
        action=getattr(device, "action", None) or props.get("ACTION") or "",
        bdf=bdf_from_devpath(devpath),
        subsystem=getattr(device, "subsystem", None) or props.get("SUBSYSTEM") or "",
        sys_path=sys_path,
        sys_name=getattr(device, "sys_name", "") or os.path.basename(devpath),
        pci_class=pci_class,
    )


class UdevMonitor:
    """`async for ev in UdevMonitor().events()`: drm and pci device events, read from a
    non-blocking netlink socket registered with the loop (`loop.add_reader`), in bounded
    batches."""

    def __init__(self, subsystems: tuple[str, ...] = ("drm", "pci"), source: str = "auto",
                 batch: int = 256, run_dir: str = "/run/udev") -> None:
        if source not in ("auto", "udev", "kernel"):
            raise ValueError(f"udev source {source!r} must be auto, udev or kernel")
        self.subsystems = subsystems
        self.source = source
        self.batch = batch
        self.run_dir = run_dir
        self.dropped = 0
        self._monitor = None

    def start(self) -> None:
        if self._monitor is not None:
            return
        try:
            import pyudev
        except ImportError as e:  # pragma: no cover - pyudev is a dependency
            raise UdevError(f"pyudev is not importable ({e}); install pyudev and libudev") from None
        source = self.source
        if source == "auto":
            # udevd's control socket: its events carry rules' properties; otherwise read
            # the kernel's uevents directly.
            source = "udev" if os.path.exists(os.path.join(self.run_dir, "control")) else "kernel"
        try:
            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context, source=source)
            if source == "udev":
                for subsystem in self.subsystems:
                    monitor.filter_by(subsystem)
            try:
                monitor.set_receive_buffer_size(4 * 1024 * 1024)
            except (OSError, ValueError):
                pass  # needs CAP_NET_ADMIN beyond rmem_max; the default still works
            monitor.start()
        except (OSError, ImportError) as e:
            raise UdevError(f"cannot open the udev netlink monitor (source {source}): {e}") from None
        self.active_source = source
        self._monitor = monitor

    def fileno(self) -> int:
        self.start()
        return self._monitor.fileno()  # type: ignore[union-attr]

    def poll_batch(self) -> list[DeviceEvent]:
        """Events waiting now (at most `batch`), without blocking."""
        self.start()
        out: list[DeviceEvent] = []
        for _ in range(self.batch):
            try:
                device = self._monitor.poll(timeout=0)  # type: ignore[union-attr]
            except OSError as e:
                # ENOBUFS: the socket overflowed during a burst; events were dropped.
                self.dropped += 1
                log.warning("udev monitor: %s; some device events were lost", e)
                continue
            if device is None:
                break
            ev = device_event(device)
            if ev.subsystem in self.subsystems:
                out.append(ev)
        return out

    async def events(self) -> AsyncIterator[DeviceEvent]:
        self.start()
        loop = asyncio.get_running_loop()
        fd = self.fileno()
        try:
            while True:
                batch = self.poll_batch()
                for ev in batch:
                    yield ev
                if batch:
                    await asyncio.sleep(0)
                    continue
                fut: asyncio.Future[None] = loop.create_future()
                loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
                try:
                    await fut
                finally:
                    loop.remove_reader(fd)
        finally:
            self.close()

    def close(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            try:
                monitor.stop()
            except Exception:  # noqa: BLE001 - closing a dead socket
                pass

"""The udev monitor with real uevents: `echo change > /sys/bus/pci/devices/<bdf>/uevent`
makes the kernel send one, and the monitor must deliver it with that address."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.kernel.router import KernelEventRouter
from gpuguard.kernel.rules import Rules
from gpuguard.kernel.udev import DeviceEvent, UdevMonitor, bdf_from_devpath

pytestmark = [pytest.mark.root]  # registered in pyproject.toml


def _a_pci_device() -> str:
    devices = SysfsRoot("/").listdir("/sys/bus/pci/devices")
    if not devices:
        pytest.skip("no PCI devices on this host")
    return devices[-1]


@pytest.fixture
def root_only():
    if os.geteuid() != 0:
        pytest.skip("needs root: writing a device's uevent file triggers a uevent")


def test_real_change_uevent_reaches_the_monitor(root_only):
    bdf = _a_pci_device()

    async def main():
        monitor = UdevMonitor()
        monitor.start()
        got: list[DeviceEvent] = []

        async def consume():
            async for ev in monitor.events():
                got.append(ev)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # let the consumer register with the loop
        SysfsRoot("/").write_text(f"/sys/bus/pci/devices/{bdf}/uevent", "change")
        deadline = time.monotonic() + 2.0
        mine = lambda: [e for e in got if e.bdf == bdf and e.action == "change"]  # noqa: E731
        while not mine() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return mine()

    events = asyncio.run(main())
    assert events, f"no change uevent for {bdf} within 2 s"
    ev = events[0]
    action, ev_bdf, subsystem, sys_path = ev  # unpacks as the integrator expects
    assert (action, ev_bdf, subsystem) == ("change", bdf, "pci")
    assert sys_path.endswith("/" + bdf)
    assert ev.pci_class is not None  # the kernel's pci uevent carries PCI_CLASS


def test_a_change_passes_through_the_router_without_an_event(root_only):
    bdf = _a_pci_device()
    seen: list[DeviceEvent] = []

    class Hooks:
        def on_device_change(self, dev):
            seen.append(dev)

    async def main():
        monitor = UdevMonitor()
        router = KernelEventRouter(Rules.load(), gpu_name_for_bdf={bdf: "gpu-x"}.get, hooks=Hooks())
        task = asyncio.create_task(router.run_udev(monitor))
        while monitor._monitor is None:
            await asyncio.sleep(0.001)
        SysfsRoot("/").write_text(f"/sys/bus/pci/devices/{bdf}/uevent", "change")
        deadline = time.monotonic() + 2.0
        while not any(d.bdf == bdf for d in seen) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return router

    router = asyncio.run(main())
    assert any(d.bdf == bdf and d.action == "change" for d in seen)
    assert not [e for e in router.events if e.bdf == bdf]


def test_addresses_come_from_the_device_path_even_after_removal():
    assert bdf_from_devpath("/devices/pci0000:a0/0000:a0:02.0/0000:a1:00.0/0000:a2:08.0/0000:aa:00.0/drm/card1") == "0000:aa:00.0"
    assert bdf_from_devpath("/devices/pci0000:00/0000:00:02.0") == "0000:00:02.0"
    assert bdf_from_devpath("/devices/virtual/drm/ttm") is None
    assert DeviceEvent("add", "0000:aa:00.0", "drm", "/sys/x/drm/card1", sys_name="card1").is_drm_card
    assert not DeviceEvent("add", "0000:aa:00.0", "drm", "/sys/x/drm/renderD128", sys_name="renderD128").is_drm_card
    assert not DeviceEvent("add", "0000:aa:00.0", "drm", "/sys/x/drm/card1-DP-1", sys_name="card1-DP-1").is_drm_card

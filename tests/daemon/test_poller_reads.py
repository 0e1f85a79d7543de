"""How the poller reads: every answering card on ONE device thread per cycle (a thread
handoff per GPU was most of an idle daemon's CPU), a card that does not answer left to its
thread and reported, the cards not read yet sent out one per thread so a second wedged
card costs no more than the first; and the periodic discovery walks the PCI bus only when
the set of devices bound to amdgpu changed."""
from __future__ import annotations

import asyncio
import os
import threading
import time

from gpuguard.hw.sources import AmdgpuSource
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.poller import GpuPoller
from gpuguard.sim.runner import build_scenario
from gpuguard.sim.tree import write_tree
from gpuguard.state.hub import Hub
from gpuguard.state.snapshot import GpuSnapshot

BDFS = ["0000:05:00.0", "0000:08:00.0", "0000:aa:00.0", "0000:b0:00.0"]


class Dev:
    def __init__(self, bdf: str) -> None:
        self.bdf, self.vendor, self.device_id, self.model, self.driver = bdf, "1002", "7551", "R9700", "amdgpu"
        self.subsystem, self.revision, self.card = "1002:0000", "c0", None


class Cards:
    """A GPU source whose reads of the cards in `wedged` block until released, as a read
    of a card that stopped answering blocks in the driver. Records the reading threads."""

    name = "amdgpu"

    def __init__(self) -> None:
        self.wedged: dict[str, threading.Event] = {}
        self.threads: set[str] = set()

    def discover(self):
        return [Dev(b) for b in BDFS]

    def read(self, dev: Dev, name: str) -> GpuSnapshot:
        self.threads.add(threading.current_thread().name)
        gate = self.wedged.get(dev.bdf)
        if gate is not None:
            gate.wait(30)
        return GpuSnapshot(name=name, bdf=dev.bdf, vendor="1002", device_id="7551", driver="amdgpu", model="R9700", card=None,
                           up=True, time=time.time(), power_watts=100.0)


def run(coro):
    return asyncio.run(coro)


def by_bdf(snap) -> dict[str, GpuSnapshot]:
    return {g.bdf: g for g in snap.gpus}


def test_answering_cards_are_read_on_one_device_thread():
    cards = Cards()
    poller = GpuPoller(Hub(), [cards], timeout=2.0)

    async def main():
        return [await poller.poll_once() for _ in range(5)]

    try:
        snaps = run(main())
    finally:
        poller.close()
    assert all(g.up and g.power_watts == 100.0 for s in snaps for g in s.gpus)
    assert len(snaps[-1].gpus) == 4
    # discovery and five cycles of four reads: one worker, reused
    assert len(cards.threads) == 1, cards.threads
    assert poller.calls.started == 1


def test_a_wedged_card_is_reported_and_the_others_are_read_in_the_same_cycle():
    cards = Cards()
    gate = cards.wedged[BDFS[0]] = threading.Event()  # the first in the batch: all others wait behind it
    poller = GpuPoller(Hub(), [cards], timeout=0.5)

    async def main():
        first = await poller.poll_once()
        t0 = time.monotonic()
        second = await poller.poll_once()
        second_s = time.monotonic() - t0
        gate.set()
        for _ in range(200):  # the stuck read returns on its thread; the next cycle reads it again
            await asyncio.sleep(0.01)
            if not poller._stuck or all(s.done() for s in poller._stuck.values()):
                break
        third = await poller.poll_once()
        return first, second, second_s, third

    try:
        first, second, second_s, third = run(main())
    finally:
        gate.set()
        poller.close()
    one = by_bdf(first)
    assert not one[BDFS[0]].up
    assert one[BDFS[0]].errors == {"read": "read timed out after 0.5 s; device not answering"}
    assert all(one[b].up and one[b].power_watts == 100.0 for b in BDFS[1:])
    two = by_bdf(second)
    assert two[BDFS[0]].errors == {"read": "an earlier read is still stuck (> 0.5 s); device not answering"}
    assert all(two[b].up for b in BDFS[1:])
    # the stuck card is not waited for again: the cycle is as quick as the others' reads
    assert second_s < 0.5, second_s
    assert all(g.up for g in third.gpus)


def test_two_wedged_cards_in_one_cycle_cost_no_more_than_two_timeouts():
    cards = Cards()
    gates = [cards.wedged.setdefault(b, threading.Event()) for b in (BDFS[0], BDFS[2])]
    poller = GpuPoller(Hub(), [cards], timeout=0.5)

    async def main():
        await poller.discover()
        t0 = time.monotonic()
        snap = await poller.poll_once()
        return snap, time.monotonic() - t0

    try:
        snap, took = run(main())
    finally:
        for g in gates:
            g.set()
        poller.close()
    got = by_bdf(snap)
    assert [b for b in BDFS if not got[b].up] == [BDFS[0], BDFS[2]]
    assert all("read timed out after 0.5 s" in got[b].errors["read"] for b in (BDFS[0], BDFS[2]))
    assert got[BDFS[1]].up and got[BDFS[3]].up
    # one timeout for the batch, one for the cards sent out after it (in parallel), not one
    # per card in turn; generous slack for a loaded 2-core machine
    assert took < 2 * 0.5 + 1.0, took


class CountingAmdgpu(AmdgpuSource):
    def __init__(self, root: SysfsRoot) -> None:
        super().__init__(root)
        self.walks = 0

    def discover(self):
        self.walks += 1
        return super().discover()


def test_periodic_discovery_walks_the_bus_only_when_the_bound_devices_change(tmp_path):
    write_tree(build_scenario("incident"), str(tmp_path))
    source = CountingAmdgpu(SysfsRoot(str(tmp_path)))
    poller = GpuPoller(Hub(), [source], discover_every=0.0)  # a periodic look at every cycle
    bound = tmp_path / "sys/bus/pci/drivers/amdgpu"

    async def cycles(n: int):
        for _ in range(n):
            snap = await poller.poll_once()
        return snap

    try:
        snap = run(cycles(3))
        assert source.walks == 1 and len(snap.gpus) == 4
        # the driver binds a card at an address it did not have: the next look walks the bus
        gone = bound / "0000:b0:00.0"
        target = os.readlink(gone)
        gone.unlink()
        snap = run(cycles(1))
        assert source.walks == 2
        os.symlink(target, gone)
        snap = run(cycles(2))
        assert source.walks == 3 and len(snap.gpus) == 4
        # a discovery asked for (udev, a renumbered hwmon) walks even when nothing is new
        poller.request_discovery()
        run(cycles(1))
        assert source.walks == 4
    finally:
        poller.close()


def test_a_driver_loaded_after_start_is_a_change(tmp_path):
    source = AmdgpuSource(SysfsRoot(str(tmp_path)))
    assert source.unchanged() is False  # never discovered
    source.discover()
    assert source.unchanged() is True  # no amdgpu bound, still none
    bound = tmp_path / "sys/bus/pci/drivers/amdgpu"
    bound.mkdir(parents=True)
    (bound / "0000:03:00.0").symlink_to("../../../../devices/pci0000:00/0000:00:01.0/0000:03:00.0")
    assert source.unchanged() is False


def test_cycles_after_the_first_start_on_multiples_of_the_interval():
    """The poll's wakeups share the power sampler's grid (hw/power_sampler.on_grid): each
    cycle after the first, which runs at once, starts on a multiple of the interval of the
    loop's monotonic clock."""
    starts: list[float] = []

    async def main() -> None:
        poller = GpuPoller(Hub(), [Cards()], [], interval=0.2, timeout=2.0)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        poller.on_cycle.append(lambda snap: starts.append(loop.time()) or (len(starts) >= 8 and stop.set()))
        try:
            await asyncio.wait_for(poller.run(stop), 30)
        finally:
            poller.close()

    run(main())
    # a cycle ends a little after it starts: its listeners run at start + the read's time
    phases = sorted(t % 0.2 for t in starts[1:])
    assert phases[len(phases) // 2] < 0.03, phases
    gaps = [b - a for a, b in zip(starts[1:], starts[2:])]
    assert all(0.1 < g < 0.3 for g in gaps), gaps


def test_a_hwmon_folder_that_vanishes_and_returns_under_its_name_is_read_again(tmp_path):
    """`mv hwmon5` away and back on a plain tree: the discovery made while it was gone found
    no hwmon, and nothing looked again, so power and fan stayed absent with `errors` {} and
    the error counter frozen. Gone, it is an error every cycle; back, it is read again."""
    write_tree(build_scenario("incident"), str(tmp_path))
    hub = Hub()
    poller = GpuPoller(hub, [AmdgpuSource(SysfsRoot(str(tmp_path)))], discover_every=5.0)
    xtx0 = "0000:aa:00.0"
    (hwmon,) = (tmp_path / f"sys/bus/pci/devices/{xtx0}/hwmon").iterdir()
    away = tmp_path / "away"

    async def cycle() -> GpuSnapshot:
        return by_bdf(await poller.poll_once())[xtx0]

    def errors() -> float:
        return sum(n for (gpu, _), n in hub.counters.poll_errors.items() if gpu == hub.gpus.name(xtx0))

    try:
        g = run(cycle())
        assert g.power_watts is not None and g.fan_rpm is not None and g.errors == {}
        hwmon.rename(away)
        counted = []
        for _ in range(4):  # the read that fails, the discovery that finds no hwmon, and on
            g = run(cycle())
            counted.append(errors())
            assert g.up and g.power_watts is None and g.fan_rpm is None
            assert hwmon.name in g.errors.get("hwmon", "") or any(hwmon.name in e for e in g.errors.values()), g.errors
        assert counted == sorted(set(counted)), counted  # counted every cycle, never frozen
        away.rename(hwmon)
        g = None
        for _ in range(3):  # a look at the returned folder, then its reads
            g = run(cycle())
            if g.power_watts is not None:
                break
        assert g.power_watts is not None and g.fan_rpm is not None and g.errors == {}, g.errors
        assert any(d.hwmon_path and d.hwmon_path.endswith("/" + hwmon.name) for _, d in poller.devices.values())
    finally:
        poller.close()

"""Findings are conditions, not edges (issue 14): the demo's Gen2 slot hop raises one alert
while the load swings between idle and busy for ten minutes, and one clear when it ends."""
from __future__ import annotations

import asyncio

from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.hw.sources import AmdgpuSource
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.pcie_walker import PcieWalker
from gpuguard.policy.doctor import diagnose, link_findings
from gpuguard.policy.pcie_findings import PcieFindings
from gpuguard.poller import GpuPoller
from gpuguard.sim.host import SimHost
from gpuguard.sim.topology import incident_spec
from gpuguard.sim.tree import write_tree
from gpuguard.state.conditions import Conditions
from gpuguard.state.events import Event
from gpuguard.state.hub import Hub
import pytest

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


XTX = ("0000:aa:00.0", "0000:b0:00.0")


def pcie_watch(hub: Hub, root: SysfsRoot, expected=dict, interval: float = 60.0, **findings) -> PcieWalker:
    """The daemon's wiring: the walker (a source) with the findings (policy) handed in."""
    f = PcieFindings(hub, root, expected, **findings)
    return PcieWalker(hub, root, interval=interval, assess=f.assess, publish=f.publish)


def ev(msg: str) -> Event:
    return Event("pcie_link", "alert", "pcie", msg, bdf=XTX[0])


def test_conditions_raise_once_clear_once_with_debounce():
    c = Conditions(raise_after=1, clear_after=2)
    assert [e.kind for e in c.update({"k": ev("runs 5 GT/s under load")})] == ["pcie_link"]
    assert c.update({"k": ev("other text, same condition")}) == []
    assert c.update({}) == []  # one check without it: not yet cleared (debounce)
    assert c.update({"k": ev("back")}) == []  # still the same condition
    assert c.update({}) == [] and [e.kind for e in c.update({})] == ["pcie_link_cleared"]
    cleared = c.update({"k": ev("again")})
    assert [e.severity for e in cleared] == ["alert"] and c.active == {"k"}
    assert c.drop("k").message.startswith("cleared: ") and c.active == frozenset()


def test_ten_minutes_of_idle_busy_cycles_on_the_demo_raise_the_downgrade_alert_once(tmp_path):
    host = SimHost(incident_spec())
    writer = write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    hub = Hub()
    got: list[Event] = []
    hub.on_event(got.append)
    clock = [1_000_000.0]
    poller = GpuPoller(hub, [AmdgpuSource(root)], interval=10, timeout=30)
    # The demo config expects xtx-0's slot at Gen4 x16 (INCIDENTS §4: it trained at Gen2).
    expected = {XTX[0]: ExpectedLink(gen=4, width=16)}
    watch = pcie_watch(hub, root, lambda: expected, interval=10, clock=lambda: clock[0])

    async def ten_minutes():
        busy_seen = idle_seen = 0
        for i in range(60):  # a PCIe check every 10 s; the load flips every 30 s
            load = 1.0 if (i // 3) % 2 == 0 else 0.0
            for b in XTX:
                host.set_load(b, load)
            host.step(10.0)
            writer.refresh()
            clock[0] += 10
            await poller.poll_once()
            report = await watch.check_once()
            busy_seen += report.gpu(XTX[0]).busy
            idle_seen += not report.gpu(XTX[0]).busy
        poller.close()
        return busy_seen, idle_seen

    busy_seen, idle_seen = asyncio.run(ten_minutes())
    assert busy_seen >= 20 and idle_seen >= 20  # the load really did swing
    links = [e for e in got if e.kind.startswith(("pcie_link", "pcie_expect_link"))]
    assert sorted((e.kind, e.bdf) for e in links) == [
        ("pcie_expect_link", XTX[0]), ("pcie_link", XTX[0]), ("pcie_link", XTX[1])], [e.message for e in links]
    # While idle, doctor's finding still names the fault and when it was seen under load.
    idle = [f for f in hub.view("pcie_findings") if f.check == "link" and f.where.startswith(XTX[0])]
    assert idle and idle[0].level == "FAIL" and "downgraded under load" in idle[0].what


def test_doctor_without_history_calls_an_idle_slow_link_power_saving(tmp_path):
    host = SimHost(incident_spec())
    write_tree(host, str(tmp_path / "sim"))
    from gpuguard.hw.pcie import walk

    g = walk(SysfsRoot(str(tmp_path / "sim"))).gpu(XTX[0])
    fs = [f for f in link_findings(g) if f.check == "link"]
    assert fs and all(f.level == "OK" and "power-saving while idle" in f.what for f in fs)
    slot = next(h.link for h in g.hops if h.link and h.link.downgraded)
    seen = {(g.bdf, slot.upper, slot.lower): (0.0, 5.0)}
    fs = [f for f in diagnose(SysfsRoot(str(tmp_path / "sim")), walk(SysfsRoot(str(tmp_path / "sim"))),
                              seen_under_load=seen) if f.check == "link" and f.where.startswith(XTX[0])]
    assert fs[0].level == "FAIL" and "downgraded under load (seen at" in fs[0].what


def test_the_load_history_survives_a_restart_and_reaches_doctor(tmp_path):
    """The daemon keeps the links it saw slow under load in its state dir; a restarted
    daemon and `gpuguard doctor` judge an idle hop by it; a reboot (btime) forgets it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from gpuguard.policy.link_history import FILE

    host = SimHost(incident_spec())
    writer = write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    (tmp_path / "sim/proc").mkdir(exist_ok=True)
    (tmp_path / "sim/proc/stat").write_text("cpu  1 2 3\nbtime 1000\n")
    history = str(tmp_path / "state" / FILE)
    hub = Hub()
    poller = GpuPoller(hub, [AmdgpuSource(root)], interval=10, timeout=30)

    async def one_check(load: float, watch: PcieWalker):
        for b in XTX:
            host.set_load(b, load)
        host.step(10.0)
        writer.refresh()
        await poller.poll_once()
        return await watch.check_once()

    busy_watch = pcie_watch(hub, root, clock=lambda: 5000.0, history_path=history)
    asyncio.run(one_check(1.0, busy_watch))
    saved = json.loads(Path(history).read_text())
    assert {(e["gpu"], e["gts"]) for e in saved["links"]} == {(XTX[0], 5.0), (XTX[1], 5.0)}
    restarted = PcieFindings(Hub(), root, clock=lambda: 6000.0, history_path=history)
    assert set(k[0] for k in restarted.seen_under_load) == set(XTX)
    poller.close()

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "daemon"), NO_COLOR="1")
    for b in XTX:
        host.set_load(b, 0.0)
    host.step(10.0)
    writer.refresh()

    def doctor(*extra):
        p = subprocess.run([sys.executable, "-m", "gpuguard", "doctor", "--sysfs-root", str(tmp_path / "sim"), *extra],
                           env=env, capture_output=True, text=True, timeout=120)
        return [ln for ln in p.stdout.splitlines() if " link " in ln and XTX[0] in ln]

    assert all(ln.startswith("OK") and "power-saving while idle" in ln for ln in doctor())
    seen = doctor("--history", history)
    assert seen and all(ln.startswith("FAIL") and "downgraded under load (seen at" in ln for ln in seen), seen
    (tmp_path / "sim/proc/stat").write_text("btime 9000\n")  # rebooted since: the link trained again
    assert all(ln.startswith("OK") for ln in doctor("--history", history))


def test_a_link_event_at_a_switch_port_carries_the_name_of_the_gpus_behind_it(tmp_path):
    """A finding placed at a hop (a switch port, not the card) is named after the GPU whose
    path holds it; a port shared by both XTX cards names both; an address on no GPU's path
    stays unnamed (issue 21: `"gpu": null` on pcie_link events)."""
    from gpuguard.hw.pcie import walk

    host = SimHost(incident_spec())
    write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    report = walk(root)
    names = {XTX[0]: "xtx-0", XTX[1]: "xtx-1"}
    watch = PcieFindings(Hub(), root, gpu_names=lambda: names)
    path0 = [h.bdf for h in report.gpu(XTX[0]).hops if h.bdf != XTX[0]]
    path1 = {h.bdf for h in report.gpu(XTX[1]).hops}
    own = next(b for b in reversed(path0) if b not in path1)  # xtx-0's slot port on the switch
    shared = next(b for b in reversed(path0) if b in path1)  # the switch port both cards sit behind

    def named(bdf: str) -> str | None:
        return watch._named(Event("pcie_link", "alert", "pcie", f"{bdf}: link downgraded", bdf=bdf), report).gpu

    assert named(own) == "xtx-0"
    assert named(shared) == "xtx-0,xtx-1"
    assert named(XTX[1]) == "xtx-1"
    assert named("0000:ee:00.0") is None
    # an event already naming its GPU keeps it
    assert watch._named(Event("pcie_link", "alert", "pcie", "x", bdf=own, gpu="other"), report).gpu == "other"


def test_a_walk_that_finds_what_the_last_one_did_keeps_its_report_object(tmp_path):
    """/metrics serves the PCIe block as rendered while the report is the same object; an
    unchanged walk must not look like a new report (at 32 GPUs its re-render was the p99)."""
    host = SimHost(incident_spec())
    writer = write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    hub = Hub()
    watch = pcie_watch(hub, root, lambda: {}, interval=10)

    async def walks():
        first = await watch.check_once()
        second = await watch.check_once()
        assert hub.view("pcie") is first
        for b in XTX:  # the load changes what the walk sees (busy, and the slot hop's speed)
            host.set_load(b, 1.0)
        host.step(10.0)
        writer.refresh()
        poller = GpuPoller(hub, [AmdgpuSource(root)], interval=10, timeout=30)
        await poller.poll_once()
        poller.close()
        third = await watch.check_once()
        return first, second, third

    first, second, third = asyncio.run(walks())
    assert second is first
    assert hub.view("pcie") is third and third is not first and third != first and third.gpu(XTX[0]).busy


def walked(host: SimHost, tmp_path, **findings) -> tuple:
    """(report, hub, PcieFindings, events published) for `host` written below tmp_path."""
    from gpuguard.hw.pcie import walk

    write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    hub = Hub()
    got: list[Event] = []
    hub.on_event(got.append)
    return walk(root), hub, PcieFindings(hub, root, **findings), got


def test_gpu_pairs_that_need_the_same_fix_are_one_condition_and_doctor_keeps_every_pair(tmp_path):
    """Behind one host bridge without P2P every pair of GPUs is a finding: 28 at 8 GPUs, 496
    at 32, and each was its own warning at every start: half the event log (1 000 events)
    at 32 GPUs, and 0.9 MiB held (issue 15). The pairs that need the same fix (one `todo`)
    are one condition; the findings (doctor, /v1/pcie) still list every pair."""
    # 8 GPUs: six on the chipset's host bridge
    report, hub, watch, got = walked(SimHost.incident(extra_gpus=4), tmp_path)
    findings = watch.assess(report)
    pairs = [f for f in findings if f.check == "pair" and f.level != "OK"]
    assert len(pairs) == 28
    fixes = {f.todo for f in pairs}
    watch.publish(report, findings)
    pair_events = [e for e in got if e.kind == "pcie_pair"]
    assert len(pair_events) == len(fixes) < len(pairs)
    assert {e.fields["todo"] for e in pair_events} == fixes
    assert sum(e.fields.get("pairs", 1) for e in pair_events) == 28
    bridge = next(e for e in pair_events if "one switch" in e.fields["todo"])
    assert bridge.fields["pairs"] == 15 and bridge.message.startswith("15 GPU pairs, ")
    assert "gpuguard doctor" in bridge.message and bridge.severity == "warning"
    assert len([f for f in hub.view("pcie_findings") if f.check == "pair"]) == 28
    # the next walk finds the same: nothing new
    got.clear()
    watch.publish(report, watch.assess(report))
    assert got == []


def test_a_pair_alone_in_its_fix_keeps_its_own_message_and_gpu(tmp_path):
    report, hub, watch, got = walked(SimHost(incident_spec()), tmp_path,
                                     gpu_names=lambda: {"0000:05:00.0": "r9700-0"})
    watch.publish(report, watch.assess(report))
    alone = [e for e in got if e.kind == "pcie_pair" and "pairs" not in e.fields]
    assert [e.message.split(": ", 1)[0] for e in alone if "one switch" in e.fields["todo"]] == [
        "0000:05:00.0 ↔ 0000:08:00.0"]
    assert next(e for e in alone if e.message.startswith("0000:05:00.0 ↔ 0000:08:00.0")).gpu == "r9700-0"


def _about(f, bdf: str) -> bool:
    """The finding is placed at that GPU (or on its path), or is a pair it is in."""
    return bdf in f.where.split(" ↔ ") if f.check == "pair" else f.where.split(" ", 1)[0] == bdf


def test_a_lost_gpu_keeps_its_findings_marked_lost_until_it_is_back_and_walked_again(tmp_path):
    """`sim lose xtx-1`: ~10 s later pcie_link_cleared, pcie_bar_cleared, pcie_pair_cleared
    ("cleared: … downgraded under load") and the Gen2 alert resolved, though nothing was
    fixed. A lost card keeps its findings, marked "GPU lost", in /v1/pcie's findings and on
    /metrics (its last walked series, `gpuguard_gpu_pcie_held` 1) until it is back and
    walked again; only what that walk shows fixed clears."""
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from gpuguard.sinks.pcie_metrics import PcieCollector

    host = SimHost(incident_spec())
    writer = write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    hub = Hub()
    got: list[Event] = []
    hub.on_event(got.append)
    clock = [1000.0]  # the poller's: a discovery at every 10 s step, as in the daemon
    poller = GpuPoller(hub, [AmdgpuSource(root)], interval=10, timeout=30, clock=lambda: clock[0])
    findings = PcieFindings(hub, root, gpu_names=hub.gpus.names)
    watch = PcieWalker(hub, root, interval=10, assess=findings.assess, publish=findings.publish)
    reg = CollectorRegistry()
    reg.register(PcieCollector(lambda: findings.reported, gpu_names=hub.gpus.names, held=lambda: findings.held))
    lost = XTX[1]
    name = hub.gpus.name

    async def walks(n: int = 1, load: float = 1.0):
        for _ in range(n):
            for b in host.gpus:
                host.set_load(b, load)
            host.step(10.0)
            writer.refresh()
            clock[0] += 10
            await poller.poll_once()
            await watch.check_once()

    def metric(family: str, **labels) -> list[str]:
        text = generate_latest(reg).decode()
        return [ln for ln in text.splitlines() if ln.startswith(family + "{")
                and all(f'{k}="{v}"' in ln for k, v in labels.items())]

    def mine() -> dict[tuple[str, str], object]:
        return {(f.check, f.where): f for f in hub.view("pcie_findings") if _about(f, lost) and f.level != "OK"}

    async def scenario():
        await walks(2)
        before = mine()
        assert {k[0] for k in before} >= {"link", "bar", "pair"}, before
        assert any(ln.endswith(" 1.0") for ln in metric("gpuguard_pcie_link_downgraded", gpu=name(lost)))
        raised = [e.kind for e in got if e.source == "pcie"]
        host.lose_gpu(lost)  # reads fail first, then the board leaves the bus
        await walks(6)
        assert hub.view("pcie").gpu(lost) is None  # really gone from the walk
        assert hub.gpus.is_lost(lost)
        assert [e.kind for e in got if e.kind.endswith("_cleared")] == []
        assert [e.kind for e in got if e.source == "pcie"] == raised  # nothing new either
        held = mine()
        assert held.keys() == before.keys()
        for key, f in held.items():
            assert f.level == before[key].level
            assert f.what.startswith("GPU lost") and before[key].what in f.what
            assert f.to_dict()["gpu_lost"] is True
        assert not any(f.to_dict()["gpu_lost"] for f in hub.view("pcie_findings") if not _about(f, lost))
        # /metrics: its last walked series stay (the downgrade alert holds), marked held
        assert any(ln.endswith(" 1.0") for ln in metric("gpuguard_pcie_link_downgraded", gpu=name(lost)))
        assert metric("gpuguard_gpu_pcie_held", gpu=name(lost)) == [f'gpuguard_gpu_pcie_held{{gpu="{name(lost)}"}} 1.0']
        assert metric("gpuguard_gpu_pcie_held", gpu=name(XTX[0]))[0].endswith(" 0.0")
        # back in its slot, walked again: still Gen2, still a small BAR: nothing clears
        host.return_gpu(lost)
        await walks(4)
        assert hub.view("pcie").gpu(lost) is not None and not hub.gpus.is_lost(lost)
        assert [e.kind for e in got if e.kind.endswith("_cleared")] == []
        again = mine()
        assert again.keys() == before.keys() and not any(f.to_dict()["gpu_lost"] for f in again.values())
        assert metric("gpuguard_gpu_pcie_held", gpu=name(lost))[0].endswith(" 0.0")
        # what the walk after the return shows fixed clears, and only that: a file that read
        # garbage before the loss is sane again when the card is back
        host.garbage(lost, "mem_info_vis_vram_total", "xyz\n")
        await walks(2)
        assert ("read", lost) in {(k[0], k[1]) for k in mine()}
        host.lose_gpu(lost)
        await walks(4)
        assert [e.kind for e in got if e.kind.endswith("_cleared")] == []
        assert ("read", lost) in {(k[0], k[1]) for k in mine()}
        host.clear_garbage(lost)
        host.return_gpu(lost)
        await walks(4)
        assert [(e.kind, e.bdf) for e in got if e.kind.endswith("_cleared")] == [("pcie_read_cleared", lost)]
        assert mine().keys() == before.keys()
        poller.close()

    asyncio.run(scenario())


def test_a_kernel_p2p_refusal_walks_at_once_and_is_kept_for_the_next_start(tmp_path):
    """Without root (no /dev/kmsg write): the classified refusal as the router publishes it.
    The walker walks at once (not at its hour's interval), the pair's verdict is the
    kernel's, and the line is in the state folder for a restarted daemon (which resumes the
    kernel log after it) and for doctor."""
    from gpuguard.policy.link_history import KERNEL_FILE, load_kernel_lines

    refusal = "amdgpu 0000:08:00.0: amdgpu: PCIe P2P access from peer device 0000:05:00.0 is not supported by the chipset"
    host = SimHost(incident_spec())
    write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    path = str(tmp_path / "state" / KERNEL_FILE)

    def wiring():
        hub = Hub()
        f = PcieFindings(hub, root, kernel_path=path)
        return hub, f, PcieWalker(hub, root, interval=3600, kernel_lines=f.kernel_lines, assess=f.assess,
                                  publish=f.publish)

    def verdict(hub) -> str:
        return hub.view("pcie").pair("0000:05:00.0", "0000:08:00.0").verdict

    hub, findings, walker = wiring()

    async def running():
        stop = asyncio.Event()
        task = asyncio.create_task(walker.run(stop))
        deadline = asyncio.get_running_loop().time() + 30
        while hub.view("pcie") is None:
            assert asyncio.get_running_loop().time() < deadline, "no first walk"
            await asyncio.sleep(0.01)
        assert "kernel refused" not in verdict(hub)
        hub.publish(Event("p2p_unsupported", "warning", "kernel", refusal, bdf="0000:08:00.0"))
        while "kernel refused" not in verdict(hub):
            assert asyncio.get_running_loop().time() < deadline, "the refusal did not start a walk"
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(running())
    assert f"kernel refused it: {refusal}" in verdict(hub)
    pair = next(f for f in hub.view("pcie_findings") if f.where == "0000:05:00.0 ↔ 0000:08:00.0")
    assert "kernel refused it" in pair.what
    assert list(load_kernel_lines(path)) == [refusal]
    # the next start: no kernel line comes again, the verdict stays
    hub2, _, walker2 = wiring()
    asyncio.run(walker2.check_once())
    assert f"kernel refused it: {refusal}" in verdict(hub2)
    # a reboot since (btime after the line): the line is forgotten
    (tmp_path / "sim/proc").mkdir(exist_ok=True)
    (tmp_path / "sim/proc/stat").write_text(f"btime {int(__import__('time').time()) + 60}\n")
    hub3, _, walker3 = wiring()
    asyncio.run(walker3.check_once())
    assert "kernel refused" not in verdict(hub3)

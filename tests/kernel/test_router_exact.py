"""The kernel event router's exact decisions: the events a udev remove/add makes (words,
fields, card), which second report of one loss is dropped, which NVML/kmsg pair counts
once, the policy's alert marking, the route and words a loss is recorded with, each
debounce key and its edge, when a reset is recovered (at once, or after settling), and how
failing hooks and sinks are counted. bench/mutation.sh found these decisions unobserved."""
from __future__ import annotations

import asyncio
import time

import pytest

from gpuguard.kernel.kmsg import parse_record
from gpuguard.kernel.router import KernelEventRouter
from gpuguard.kernel.rules import Rules
from gpuguard.kernel.udev import DeviceEvent
from gpuguard.state.events import Event
from gpuguard.state.gpus import GpuStates

GPU, GPU2 = "0000:aa:00.0", "0000:b0:00.0"
NAMES = {GPU: "gpu0", GPU2: "gpu1"}
SUFFIX = ("; nothing is written to it until it is back; recovery is kill the engines, then reboot (cold power-cycle "
          "if the reboot does not come back)")
_seq = iter(range(1, 10**9))


class _Dev:
    def __init__(self, bdf: str) -> None:
        self.bdf, self.vendor, self.device_id, self.model = bdf, "1002", "744c", "XTX"


def states() -> GpuStates:
    s = GpuStates()
    s.observe([_Dev(b) for b in NAMES])
    return s


def rec(text: str, device: str | None = None):
    dict_lines = f"\n SUBSYSTEM=pci\n DEVICE=+pci:{device}" if device else ""
    return parse_record(f"3,{next(_seq)},{int(time.monotonic() * 1e6)},-;{text}{dict_lines}\n".encode())


class Hooks:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_alert(self, e):
        self.calls.append(("alert", e.kind, e.bdf))

    def on_gpu_lost(self, bdf):
        self.calls.append(("lost", bdf))

    def on_gpu_reset_ok(self, bdf):
        self.calls.append(("reset_ok", bdf))

    def on_gpu_fatal(self, bdf, kind):
        self.calls.append(("fatal", bdf, kind))

    def on_gpu_appeared(self, bdf):
        self.calls.append(("appeared", bdf))

    def on_device_change(self, dev):
        self.calls.append(("change", dev.action, dev.bdf))


@pytest.fixture(scope="module")
def rules() -> Rules:
    return Rules.load()


def router(rules, hooks=None, names=NAMES.get, **kw) -> KernelEventRouter:
    return KernelEventRouter(rules, names, hooks, states=kw.pop("states", None) or states(), **kw)


def pci(action: str, bdf: str = GPU, cls: int | None = 0x030000) -> DeviceEvent:
    return DeviceEvent(action, bdf, "pci", f"/sys/devices/pci0000:a0/{bdf}", bdf, cls)


def drm(action: str, bdf: str = GPU, name: str = "card1") -> DeviceEvent:
    return DeviceEvent(action, bdf, "drm", f"/sys/devices/pci0000:a0/{bdf}/drm/{name}", name)


# ------------------------------------------------------------------ udev


def test_a_udev_remove_exactly(rules):
    h = Hooks()
    r = router(rules, h)
    r.states.engines = {"qwen": (GPU,)}  # the state owner's name for the card
    e = r.handle_device(pci("remove"))
    assert (e.kind, e.severity, e.source, e.gpu, e.bdf, e.message) == (
        "gpu_lost", "critical", "udev", "gpu0", GPU, f"GPU {GPU} removed (pci remove)")
    assert dict(e.fields) == {"action": "remove", "subsystem": "pci", "sys_path": f"/sys/devices/pci0000:a0/{GPU}",
                              "condition": True, "route": "udev", "engines": ["qwen"]}
    assert r.conditions[(GPU, "gpu_lost")] is e and r.states.get(GPU).lost_by == "udev:gpu_lost"
    assert h.calls == [("alert", "gpu_lost", GPU), ("lost", GPU), ("fatal", GPU, "gpu_lost")]


def test_unbind_is_a_removal_too(rules):
    r = router(rules)
    assert r.handle_device(drm("unbind")).kind == "gpu_lost" and r.is_lost(GPU)


def test_a_second_report_of_one_loss_is_dropped_by_condition_or_by_state(rules):
    r = router(rules, policy={"gpu_lost": ["alert"]})  # a policy that does not mark the card lost
    assert r.handle_device(pci("remove")).kind == "gpu_lost" and not r.is_lost(GPU)
    assert r.handle_device(drm("remove")) is None  # the condition says it was reported
    r2 = router(rules)
    r2.states.mark_lost(GPU2, "udev", quiet=True)  # lost, without a gpu_lost condition
    assert r2.handle_device(pci("remove", GPU2)) is None


def test_a_udev_add_exactly(rules):
    h = Hooks()
    r = router(rules, h)
    r.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: device lost from bus!", GPU))
    assert {(GPU, "device_lost"), (GPU, "gpu_lost")} <= set(r.conditions)
    r.conditions[(GPU2, "device_lost")] = Event("device_lost", "critical", "kmsg", "other card")
    h.calls.clear()
    e = r.handle_device(pci("add"))
    assert (e.kind, e.severity, e.source, e.gpu, e.bdf, e.message, dict(e.fields)) == (
        "gpu_appeared", "info", "udev", "gpu0", GPU, f"GPU {GPU} appeared (pci add), was lost",
        {"action": "add", "subsystem": "pci", "sys_path": f"/sys/devices/pci0000:a0/{GPU}"})
    assert r.events[-1] is e
    assert set(r.conditions) == {(GPU2, "device_lost")}  # this card's cleared, not the other's
    s = r.states.get(GPU)
    assert (s.presence, s.pending_why) == ("present", "GPU back (udev add): stock settings")
    assert h.calls == [("appeared", GPU)]
    e = r.handle_device(drm("bind"))  # the drm side of the same appearance: within the debounce
    assert e.message == f"GPU {GPU} appeared (drm bind)" and h.calls == [("appeared", GPU)]
    r.handle_device(pci("add", GPU2))
    assert h.calls == [("appeared", GPU), ("appeared", GPU2)]  # another card: its own debounce


def test_other_device_actions_pass_through_and_non_gpus_are_ignored(rules):
    h = Hooks()
    r = router(rules, h, names=lambda b: None)
    assert r.handle_device(pci("change")) is None and h.calls == [("change", "change", GPU)]
    assert r.handle_device(pci("remove", "0000:05:00.0", 0x020000)) is None  # a NIC
    assert r.handle_device(pci("remove", "0000:06:00.0", 0x120000)).kind == "gpu_lost"  # an accelerator
    assert r.handle_device(pci("remove", "0000:07:00.0", 0x130000)) is None
    assert r.handle_device(pci("remove", "0000:08:00.0", None)) is None
    assert r.handle_device(drm("remove", "0000:09:00.0", "renderD128")) is None
    e = r.handle_device(drm("remove", "0000:09:00.0", "card2"))
    assert (e.kind, e.gpu) == ("gpu_lost", None)
    assert r.handle_device(DeviceEvent("remove", None, "pci", "/sys/x", "x", 0x030000)) is None


# ------------------------------------------------------------------ one fact, two sources


def nv(kind: str, bdf: str | None = GPU, xid: int | None = 79, t: float | None = None, source: str = "nvml") -> Event:
    fields = {"xid": xid} if xid is not None else {}
    return Event(kind, "critical", source, f"{kind} from {source}", bdf=bdf, time=t or time.time(), fields=fields)


def test_an_xid_seen_by_kmsg_and_nvml_counts_once(rules):
    r = router(rules)
    now = time.time()
    assert r.handle_external(nv("nvidia_xid", t=now, source="kmsg")) is not None
    assert r.handle_external(nv("nvidia_xid", t=now + 30)) is None  # the other source, within 30 s
    assert r.handle_external(nv("nvidia_xid", t=now + 30.5)) is not None  # later: a new one
    assert r.handle_external(nv("nvidia_xid", xid=48, t=now + 31)) is not None  # another Xid
    assert r.handle_external(nv("nvidia_xid", bdf=GPU2, t=now + 31)) is not None  # another card
    assert r.counts[(GPU, "nvidia_xid")] == 3 and r.counts[(GPU2, "nvidia_xid")] == 1


def test_only_xids_and_losses_with_a_card_are_matched(rules):
    r = router(rules)
    now = time.time()
    r.handle_external(nv("device_lost", xid=None, t=now, source="kmsg"))
    assert r.handle_external(nv("device_lost", xid=None, t=now + 1)) is None
    r.handle_external(nv("gpu_hang", xid=None, t=now, source="kmsg"))
    assert r.handle_external(nv("gpu_hang", xid=None, t=now + 1)) is not None  # other kinds: both count
    r.handle_external(nv("nvidia_xid", bdf=None, t=now, source="kmsg"))
    assert r.handle_external(nv("nvidia_xid", bdf=None, t=now + 1)) is not None  # no card: nothing to match
    assert r.handle_external(nv("nvidia_xid", t=now + 1, source="kmsg")) is not None  # the same source again


def test_only_the_last_hundred_events_are_searched(rules):
    r = router(rules, max_events=1000)
    now = time.time()
    r.handle_external(nv("nvidia_xid", t=now, source="kmsg"))
    for i in range(99):
        r.handle_external(Event("hung_task", "alert", "kmsg", f"task {i}", time=now))
    assert r.handle_external(nv("nvidia_xid", t=now + 1)) is None  # the 100th most recent: found
    r2 = router(rules, max_events=1000)
    r2.handle_external(nv("nvidia_xid", t=now, source="kmsg"))
    for i in range(100):
        r2.handle_external(Event("hung_task", "alert", "kmsg", f"task {i}", time=now))
    assert r2.handle_external(nv("nvidia_xid", t=now + 1)) is not None


def test_external_events_get_the_same_policy(rules):
    h = Hooks()
    r = router(rules, h)
    e = r.handle_external(nv("device_lost", xid=None), clears=("gpu_hang",))
    assert r.events[-1] is e and r.is_lost(GPU)
    assert h.calls == [("alert", "device_lost", GPU), ("lost", GPU), ("fatal", GPU, "device_lost")]


# ------------------------------------------------------------------ policy


def test_a_policy_without_alert_marks_the_event_so(rules):
    r = router(rules, policy={"gpu_hang": ["kill_engines"]})
    r.handle_record(rec("amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2", GPU))
    e = r.events[-1]
    assert e.fields["alert"] is False and e.fields["ring"] == "gfx_0.0.0"
    # not marked: an info event, a kind the policy does not name, a policy with alert
    r.handle_record(rec("[drm] Detected VRAM RAM=24560M, BAR=256M"))
    assert "alert" not in r.events[-1].fields
    r.handle_external(Event("oom_kill", "alert", "kmsg", "oom"))
    assert "alert" not in r.events[-1].fields
    r2 = router(rules)
    r2.handle_record(rec("amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2", GPU))
    assert "alert" not in r2.events[-1].fields


def test_a_loss_is_recorded_with_its_route_and_the_kernels_words(rules):
    r = router(rules)
    published = []
    r.states._publish = published.append
    r.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: device lost from bus!", GPU))
    s = r.states.get(GPU)
    assert (s.presence, s.lost_by) == ("lost", "kernel:device_lost")
    lost = [e for e in published if e.kind == "gpu_lost"]
    assert [e.message for e in lost] == [f"amdgpu {GPU}: amdgpu: device lost from bus!{SUFFIX}"]


def test_a_kernel_line_naming_no_gpu_marks_nothing_lost_and_recovers_nothing(rules):
    r = router(rules, policy={"hung_task": ["mark_lost", "recover"]})
    r.handle_record(rec("INFO: task python3:12 blocked for more than 120 seconds."))
    assert not any(s.presence == "lost" for s in r.states)


def test_each_action_is_debounced_per_card_and_per_action(rules):
    now = [1000.0]
    h = Hooks()
    r = router(rules, h, debounce_s=30, clock=lambda: now[0])
    hang = "amdgpu {}: ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2"
    r.handle_record(rec(hang.format(GPU), GPU))
    r.handle_record(rec(hang.format(GPU2), GPU2))
    now[0] += 29.999
    r.handle_record(rec(hang.format(GPU), GPU))
    now[0] += 0.001  # exactly the window after the first: runs again
    r.handle_record(rec(hang.format(GPU), GPU))
    assert h.calls == [("alert", "gpu_hang", GPU), ("fatal", GPU, "gpu_hang"),
                       ("alert", "gpu_hang", GPU2), ("fatal", GPU2, "gpu_hang"),
                       ("alert", "gpu_hang", GPU), ("fatal", GPU, "gpu_hang")]


def test_an_alert_does_not_debounce_the_kill_of_the_same_card(rules):
    now = [1000.0]
    h = Hooks()
    r = router(rules, h, clock=lambda: now[0], policy={"gpu_hang": ["alert"], "vm_fault": ["kill_engines"]})
    r.handle_record(rec("amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2", GPU))
    r.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:1 pasid:1)", GPU))
    r.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:1 pasid:1)", GPU))
    assert h.calls == [("alert", "gpu_hang", GPU), ("fatal", GPU, "vm_fault")]


# ------------------------------------------------------------------ recovery


OK = "amdgpu 0000:aa:00.0: amdgpu: GPU reset(2) succeeded!"


def test_recovery_without_an_event_loop_is_at_once(rules):
    h = Hooks()
    r = router(rules, h, recover_settle_s=2.0)
    r.handle_record(rec(OK, GPU))
    assert h.calls[-1] == ("reset_ok", GPU)
    s = r.states.get(GPU)
    assert (s.generation, s.pending_why) == (1, "kernel: GPU reset succeeded: the card is back at stock settings")


def test_recovery_with_no_settle_time_is_at_once_inside_a_loop_too(rules):
    h = Hooks()

    async def main():
        r = router(rules, h, recover_settle_s=0)
        r.handle_record(rec(OK, GPU))
        return list(h.calls)

    assert asyncio.run(main())[-1] == ("reset_ok", GPU)


def test_a_settled_recovery_resets_the_card_once_and_debounces(rules):
    h = Hooks()
    now = [1000.0]

    async def main():
        r = router(rules, h, recover_settle_s=0.02, clock=lambda: now[0])
        gen = r.states.get(GPU).generation
        r.handle_record(rec(OK, GPU))
        r.handle_record(rec(OK, GPU2))
        assert ("reset_ok", GPU) not in h.calls
        for _ in range(200):
            if ("reset_ok", GPU) in h.calls and ("reset_ok", GPU2) in h.calls:
                break
            await asyncio.sleep(0.005)
        assert r.states.get(GPU).generation == gen + 1 and r._recover_timers == {}
        r.handle_record(rec(OK, GPU))  # within the debounce: the card is reset, no second recovery call
        await asyncio.sleep(0.06)
        return r

    r = asyncio.run(main())
    assert h.calls.count(("reset_ok", GPU)) == 1 and h.calls.count(("reset_ok", GPU2)) == 1


def test_a_reset_recorded_with_its_reason(rules):
    r = router(rules)
    got = []
    r.states.on_reset.append(lambda s, how: got.append((s.bdf, how)))
    r.handle_record(rec(OK, GPU))
    assert got == [(GPU, "kernel: GPU reset succeeded")]


def test_a_card_lost_while_settling_is_not_recovered(rules):
    h = Hooks()

    async def main():
        r = router(rules, h, recover_settle_s=0.02)
        r.handle_record(rec(OK, GPU))
        r.states.observe([_Dev(GPU2)])  # gone from the bus meanwhile: the reset cannot bring it back
        await asyncio.sleep(0.08)
        return r

    r = asyncio.run(main())
    assert ("reset_ok", GPU) not in h.calls


# ------------------------------------------------------------------ hooks and sinks that fail


def test_failing_hooks_sinks_and_tasks_are_counted_one_each(rules):
    class Broken(Hooks):
        def on_alert(self, e):
            raise RuntimeError("notifier down")

        async def on_gpu_fatal(self, bdf, kind):
            raise RuntimeError("watchdog down")

    async def sink(e):
        raise RuntimeError("sink down")

    def broken_sink(e):
        raise RuntimeError("sink down at once")

    async def main():
        r = router(rules, Broken(), on_event=sink)
        r.handle_record(rec("amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2", GPU))
        for _ in range(5):
            await asyncio.sleep(0)
        assert r.hook_errors == 3 and r._tasks == set()  # the alert, the sink task, the fatal task
        r.on_event = broken_sink
        r.handle_record(rec("INFO: task python3:12 blocked for more than 120 seconds."))
        assert r.hook_errors == 5  # the sink, and the alert hook again
        return r

    asyncio.run(main())


def test_a_cancelled_hook_task_is_no_error(rules):
    class Slow(Hooks):
        async def on_alert(self, e):
            await asyncio.sleep(10)

    async def main():
        r = router(rules, Slow())
        r.handle_record(rec("amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2", GPU))
        (task,) = r._tasks
        task.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return r

    r = asyncio.run(main())
    assert r.hook_errors == 0 and r._tasks == set()


def test_no_hooks_or_missing_hook_methods_are_fine(rules):
    r = router(rules, None)
    r.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: device lost from bus!", GPU))
    r2 = router(rules, object())
    r2.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: device lost from bus!", GPU))
    assert r.hook_errors == r2.hook_errors == 0 and r.is_lost(GPU) and r2.is_lost(GPU)


def test_the_defaults_of_a_router():
    r = KernelEventRouter(Rules([]))
    assert (r.debounce_s, r.recover_settle_s, r.events.maxlen) == (30.0, 2.0, 1000)


def test_a_settled_recovery_is_recorded_with_its_reason(rules):
    got = []

    async def main():
        r = router(rules, Hooks(), recover_settle_s=0.02)
        r.states.on_reset.append(lambda s, how: got.append((s.bdf, how)))
        r.handle_record(rec(OK, GPU))
        for _ in range(400):
            if got:
                break
            await asyncio.sleep(0.005)
        return r

    r = asyncio.run(main())
    assert got == [(GPU, "kernel: GPU reset succeeded")]
    assert r.states.get(GPU).pending_why == "kernel: GPU reset succeeded: the card is back at stock settings"


def test_a_second_ok_line_while_settling_moves_the_recovery_not_doubles_it(rules):
    """A reset prints several "ok" lines: one recovery, settled after the last one."""
    h = Hooks()

    async def main():
        r = router(rules, h, recover_settle_s=0.2)
        gen = r.states.get(GPU).generation
        r.handle_record(rec(OK, GPU))
        await asyncio.sleep(0.1)
        r.handle_record(rec(OK, GPU))
        t_last = time.monotonic()
        while ("reset_ok", GPU) not in h.calls:
            await asyncio.sleep(0.005)
        fired_after = time.monotonic() - t_last
        await asyncio.sleep(0.3)   # a first timer not cancelled would have fired by now too
        return r, gen, fired_after

    r, gen, fired_after = asyncio.run(main())
    assert r.states.get(GPU).generation == gen + 1 and h.calls.count(("reset_ok", GPU)) == 1
    assert fired_after >= 0.19, fired_after   # settled from the second line


def test_two_cards_reset_without_a_loop_are_both_recovered(rules):
    h = Hooks()
    r = router(rules, h, recover_settle_s=2.0)
    r.handle_record(rec(OK, GPU))
    r.handle_record(rec(OK.replace(GPU, GPU2), GPU2))
    assert [c for c in h.calls if c[0] == "reset_ok"] == [("reset_ok", GPU), ("reset_ok", GPU2)]


def test_two_different_xids_from_two_sources_both_count(rules):
    r = router(rules)
    now = time.time()
    assert r.handle_external(nv("nvidia_xid", xid=79, t=now, source="kmsg")) is not None
    assert r.handle_external(nv("nvidia_xid", xid=48, t=now + 1)) is not None  # NVML, another Xid
    assert r.counts[(GPU, "nvidia_xid")] == 2


def test_a_sink_that_returns_nothing_is_no_error(rules):
    seen = []
    r = router(rules, on_event=seen.append)
    r.handle_record(rec(OK, GPU))
    assert [e.kind for e in seen] and r.hook_errors == 0


def test_udev_events_without_a_gpu_namer_carry_no_name(rules):
    r = KernelEventRouter(rules, None, None, states=states())
    e = r.handle_device(pci("remove"))
    assert (e.kind, e.gpu, e.bdf) == ("gpu_lost", None, GPU)

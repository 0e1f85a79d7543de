"""The one owner of GPU state (state/gpus.py): lost by every route, back, generations,
may_write, GPU-less kernel counters, the STATUS= summary with configured vs present."""
from __future__ import annotations

import asyncio

import pytest

from gpuguard.config.schema import GpuEntry
from gpuguard.policy.gpu_lifecycle import GpuLifecycle
from gpuguard.state.events import Event
from gpuguard.state.gpus import GpuStates
from gpuguard.state.hub import Hub
from gpuguard.sinks.metrics import MetricsSink

R9700 = ("0000:05:00.0", "0000:08:00.0")
XTX = ("0000:aa:00.0", "0000:b0:00.0")
ENTRIES = [
    GpuEntry(name="r9700-a", match={"bdf": R9700[0]}, profile="p"),
    GpuEntry(name="r9700-b", match={"bdf": R9700[1]}, profile="p"),
    GpuEntry(name="xtx-0", match={"pci_id": "1002:744c", "index": 0}, profile="x"),
    GpuEntry(name="xtx-1", match={"pci_id": "1002:744c", "index": 1}, profile="x"),
]


class Dev:
    def __init__(self, bdf: str, device_id: str) -> None:
        self.bdf, self.vendor, self.device_id, self.model = bdf, "1002", device_id, "?"


def devs(*without: str, extra: tuple = ()) -> list[Dev]:
    return [Dev(b, "7551") for b in R9700 if b not in without] + \
        [Dev(b, "744c") for b in XTX + extra if b not in without]


def make() -> tuple[Hub, GpuStates]:
    hub = Hub()
    hub.gpus.configure(ENTRIES, {"qwen": ("xtx-0",)})
    return hub, hub.gpus


def kinds(hub: Hub) -> list[str]:
    return [e.kind for e in hub.events]


def test_vanish_and_return_at_the_same_address_is_lost_then_back_and_pending():
    hub, g = make()
    g.observe(devs())
    assert g.summary() == "4/4 GPUs up" and all(s.profile_state == "pending" for s in g)
    gen = g.get(XTX[0]).generation
    g.profile_result(XTX[0], gen, True)
    g.observe(devs(XTX[0]))
    s = g.get(XTX[0])
    assert (s.presence, s.lost_by, s.on_bus, s.profile_state) == ("lost", "bus", False, "lost")
    assert not g.may_write(XTX[0]) and g.may_write(XTX[1])
    assert g.get(XTX[1]).name == "xtx-1"  # identified before: keeps its name
    assert g.summary() == "3/4 GPUs up; missing xtx-0 (1002:744c #0)"
    g.observe(devs(XTX[0]))  # still gone: one gpu_lost per loss
    assert kinds(hub).count("gpu_lost") == 1
    lost = next(e for e in hub.events if e.kind == "gpu_lost")
    assert lost.fields["route"] == "bus" and lost.fields["engines"] == ["qwen"]
    g.observe(devs())
    s = g.get(XTX[0])
    assert (s.presence, s.name, s.profile_state) == ("present", "xtx-0", "pending") and s.generation > gen
    assert g.may_write(XTX[0]) and "gpu_back" in kinds(hub)
    assert not g.profile_result(XTX[0], gen, True)  # an apply from before the loss does not count
    assert g.summary() == "4/4 GPUs up"


def test_back_at_another_address_is_reidentified_and_the_old_address_forgotten():
    hub, g = make()
    g.observe(devs())
    g.observe(devs(XTX[0]))
    assert (XTX[0], "gpu_lost") in g.conditions
    backs = []
    g.on_back.append(lambda s, how: backs.append((s.name, s.bdf, how)))
    g.observe(devs(XTX[0], extra=("0000:a0:00.0",)))
    assert g.get("0000:a0:00.0").name == "xtx-0" and g.get("0000:a0:00.0").profile_state == "pending"
    assert XTX[0] not in g and g.summary() == "4/4 GPUs up"
    # the same card back, not a new one: gpu_back at the new address, its loss no longer a condition,
    # the back policy (engine restart) runs for it
    back = [e for e in hub.events if e.kind == "gpu_back"]
    assert len(back) == 1 and (back[0].gpu, back[0].bdf) == ("xtx-0", "0000:a0:00.0")
    assert back[0].fields["previous_bdf"] == XTX[0] and "gpu_appeared" not in kinds(hub)
    assert not [k for k in g.conditions if k[0] == XTX[0]]
    assert backs == [("xtx-0", "0000:a0:00.0", f"bus (at 0000:a0:00.0, was {XTX[0]})")]
    assert "back at another address" in g.get("0000:a0:00.0").pending_why


def test_not_answering_past_the_limit_is_lost_and_answering_again_is_back():
    now = [0.0]
    hub = Hub()
    g = hub.gpus
    g.clock = lambda: now[0]
    g.lost_after_seconds = 10
    g.configure(ENTRIES)
    g.observe(devs())
    g.not_answering(XTX[1], "read timed out")
    assert g.get(XTX[1]).presence == "not_answering" and not g.may_write(XTX[1])
    now[0] = 9.9
    g.not_answering(XTX[1], "read timed out")
    assert g.get(XTX[1]).presence == "not_answering"
    now[0] = 10.0
    g.not_answering(XTX[1], "read timed out")
    assert (g.get(XTX[1]).presence, g.get(XTX[1]).lost_by) == ("lost", "not_answering")
    g.answering(XTX[1])  # one good read is not back yet: answering for the same 10 s is
    assert g.is_lost(XTX[1])
    now[0] = 20.0
    g.answering(XTX[1])
    assert g.get(XTX[1]).presence == "present" and g.get(XTX[1]).profile_state == "pending"


def test_a_kernel_loss_is_not_undone_by_a_good_read():
    hub, g = make()
    g.observe(devs())
    g.mark_lost(XTX[0], "kmsg:device_lost")
    g.answering(XTX[0])
    assert g.is_lost(XTX[0]) and not g.may_write(XTX[0])
    g.reset(XTX[0], "kernel: GPU reset succeeded")
    assert not g.is_lost(XTX[0]) and g.get(XTX[0]).profile_state == "pending"


@pytest.mark.parametrize("route", ["kmsg:device_lost", "udev", "not_answering"])
def test_a_lost_card_on_the_bus_is_back_after_answering_for_the_limit_whatever_lost_it(route):
    """The card power-cycled back without leaving the bus: lost by a kernel line, it stayed
    lost for ever while it read fine. One rule: every read answered for lost_after_seconds."""
    now = [0.0]
    hub = Hub()
    g = hub.gpus
    g.clock = lambda: now[0]
    g.lost_after_seconds = 10
    g.configure(ENTRIES)
    g.observe(devs())
    g.mark_lost(XTX[1], route)
    gen = g.get(XTX[1]).generation
    g.answering(XTX[1])  # the first good read starts the window
    now[0] = 6.0
    g.not_answering(XTX[1], "EIO")  # a failure inside it starts it anew
    now[0] = 7.0
    g.answering(XTX[1])
    now[0] = 16.9
    g.answering(XTX[1])
    assert g.is_lost(XTX[1]) and not g.may_write(XTX[1])
    now[0] = 17.0
    g.mark_lost(XTX[1], route)  # the kernel saying it again starts it anew too
    g.answering(XTX[1])
    assert g.is_lost(XTX[1])
    now[0] = 27.0
    g.answering(XTX[1])
    s = g.get(XTX[1])
    assert (s.presence, s.lost_by, s.profile_state, s.generation) == ("present", None, "pending", gen + 1)
    assert g.may_write(XTX[1]) and g.summary() == "4/4 GPUs up"
    back = [e for e in hub.events if e.kind == "gpu_back"]
    assert [e.message for e in back] == [f"GPU xtx-1 ({XTX[1]}) is back (answering again for 10 s); its profile "
                                         "is re-applied"]


def test_incomplete_group_is_unnamed_never_writable_and_alerted():
    hub, g = make()
    g.observe(devs(XTX[0]))
    s = g.get(XTX[1])
    assert not s.named and s.profile is None and not g.may_write(XTX[1])
    assert g.summary() == "3/4 GPUs up; missing xtx-0 (1002:744c #0), xtx-1 (1002:744c #1)"
    assert "gpus_missing" in kinds(hub)
    text = MetricsSink(hub).render().decode()
    assert 'gpuguard_gpu_configured_missing{gpu="xtx-0",match="1002:744c #0"} 1.0' in text
    g.observe(devs())  # the late card: the group is complete, both named
    assert g.get(XTX[1]).name == "xtx-1" and g.may_write(XTX[1]) and g.summary() == "4/4 GPUs up"


def test_begin_stop_ends_every_write():
    hub, g = make()
    g.observe(devs())
    g.begin_stop()
    assert not any(g.may_write(b) for b in R9700 + XTX)


def test_gpu_less_kernel_lines_count_under_host_and_metrics_render():
    hub, g = make()
    g.kernel_event(Event("oom_kill", "alert", "kmsg", "Out of memory: Killed process 4242"))
    g.kernel_event(Event("gpu_hang", "critical", "kmsg", "ring gfx timeout", gpu="xtx-0", bdf=XTX[0]))
    text = MetricsSink(hub).render().decode()
    assert 'gpuguard_kernel_events_total{gpu="host",kind="oom_kill"} 1.0' in text
    assert 'gpuguard_kernel_events_total{gpu="xtx-0",kind="gpu_hang"} 1.0' in text


def test_lifecycle_kills_once_per_loss_whatever_the_route_and_restarts_on_back():
    async def main():
        hub, g = make()
        g.observe(devs())
        calls = []
        lc = GpuLifecycle(g, kill=lambda gpu, why, ev: calls.append(("kill", gpu, why, ev.get("route"))),
                          restart=lambda gpu, why: calls.append(("restart", gpu, why)), debounce_s=30)
        g.mark_lost(XTX[0], "kmsg:device_lost")
        await asyncio.sleep(0)
        assert await lc.kill_engines("xtx-0", "device_lost") is False  # the kernel's own kill: debounced
        g.observe(devs(XTX[0]))  # then it leaves the bus: still one loss, one kill
        await asyncio.sleep(0.01)
        assert calls == [("kill", "xtx-0", "gpu_lost", "kmsg:device_lost")]
        g.observe(devs())
        await asyncio.sleep(0.01)
        assert calls[-1] == ("restart", "xtx-0", "gpu_back")
        g.reset(XTX[0], "kernel: GPU reset succeeded")  # present, reset: every context is gone
        await asyncio.sleep(0.01)
        assert calls[-1] == ("restart", "xtx-0", "gpu_reset_ok") and len(calls) == 3
        g.reset(R9700[0], "kernel: GPU reset succeeded")  # no engine there: nothing to restart
        await asyncio.sleep(0.01)
        assert len(calls) == 3
        await lc.aclose()

    asyncio.run(main())


def test_healthz_is_not_ok_once_no_poll_cycle_finished_within_interval_plus_timeout():
    import time

    from starlette.testclient import TestClient

    from gpuguard.sinks.api import build_app
    from gpuguard.state.hub import HostSnapshot

    hub = Hub()
    hub.poll_budget_seconds = 1.0 + 2.0 + 1.0
    client = TestClient(build_app(hub, MetricsSink(hub)))
    assert client.get("/healthz").json()["ok"] is False  # no cycle yet
    hub.publish_snapshot(HostSnapshot(time=time.time()))
    assert client.get("/healthz").json()["ok"] is True
    # the bug: a poll loop stuck behind an apply for 40 s still said ok
    hub.publish_snapshot(HostSnapshot(time=time.time() - 4.5))
    assert client.get("/healthz").json()["ok"] is False


def test_udev_remove_is_one_gpu_lost_alert_with_its_route():
    from gpuguard.kernel.router import KernelEventRouter
    from gpuguard.kernel.rules import Rules
    from gpuguard.kernel.udev import DeviceEvent

    hub, g = make()
    g.observe(devs())
    router = KernelEventRouter(Rules.load(), g.name, None, on_event=hub.publish, states=g)
    router.handle_device(DeviceEvent("remove", XTX[0], "pci", f"/sys/x/{XTX[0]}", XTX[0], 0x030000))
    g.observe(devs(XTX[0]))  # discovery then finds it gone: still the same loss
    lost = [e for e in hub.events if e.kind == "gpu_lost"]
    assert len(lost) == 1 and lost[0].fields["route"] == "udev" and lost[0].fields["engines"] == ["qwen"]
    assert g.is_lost(XTX[0]) and not g.may_write(XTX[0])


def test_the_api_refuses_a_card_that_is_lost_or_not_identified(tmp_path):
    import pytest

    from gpuguard.hw.sysfs import SysfsRoot
    from gpuguard.control.profile_actions import ProfileActions
    from gpuguard.profiles.lifecycle import ProfileRuntime
    from gpuguard.profiles.schema import ProfilesConfig, Profile
    from gpuguard.control.actions import ActionRefused, UnknownTarget

    class Writer:
        calls: list = []

        def apply(self, *a, **k):
            Writer.calls.append(a)
            raise AssertionError("nothing may be written")

    hub, g = make()
    g.observe(devs(XTX[0]))  # xtx group incomplete: b0 unnamed
    g.mark_lost(R9700[0], "kmsg:device_lost")
    cfg = ProfilesConfig(profiles={"p": Profile(power_cap_w=200), "x": Profile(sclk_max_mhz=2000)},
                         state_dir=str(tmp_path))
    rt = ProfileRuntime(cfg, g, hub, SysfsRoot(str(tmp_path)), applier=Writer(), guard=object())
    api = ProfileActions(rt)

    async def main():
        with pytest.raises(ActionRefused, match="is lost"):
            await api.apply_profile("r9700-a", "p", "token:alice")
        with pytest.raises(ActionRefused, match="not identified"):
            await api.apply_profile(XTX[1], "x", "token:alice")
        with pytest.raises(UnknownTarget):
            await api.apply_profile("xtx-0", "x", "token:alice")

    asyncio.run(main())
    assert Writer.calls == []


def test_gpu_up_is_the_state_owners_word_not_the_last_read():
    """gpuguard_gpu_up said 1 (the card read fine) while the state owner held it lost: its
    HELP says 0 = lost. The same snapshot, scraped again after the state changed, too."""
    import time

    from gpuguard.state.hub import HostSnapshot
    from gpuguard.state.snapshot import GpuSnapshot

    hub, g = make()
    g.observe(devs())
    reads = tuple(GpuSnapshot(name=g.name(b), bdf=b, vendor="1002", device_id="744c", driver="amdgpu", model="?",
                              card=None, up=True, time=time.time()) for b in R9700 + XTX)
    hub.publish_snapshot(HostSnapshot(time=time.time(), gpus=reads))
    sink = MetricsSink(hub)
    assert 'gpuguard_gpu_up{gpu="xtx-1"} 1.0' in sink.render().decode()
    g.mark_lost(XTX[1], "kernel:device_lost")
    text = sink.render().decode()
    assert 'gpuguard_gpu_up{gpu="xtx-1"} 0.0' in text and 'gpuguard_gpu_up{gpu="xtx-0"} 1.0' in text
    assert sink.registry.get_sample_value("gpuguard_gpu_up", {"gpu": "xtx-1"}) == 0.0
    g.not_answering(XTX[0], "read timed out")
    assert 'gpuguard_gpu_up{gpu="xtx-0"} 0.0' in sink.render().decode()

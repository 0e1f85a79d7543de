"""The power watch's wiring decisions: which GPUs get a sampler (not lost ones, not
runtime-suspended ones), a reloaded `power:` section taking effect, and the sampler
switched off."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuguard.config.power import PowerConfig
from gpuguard.hw import amdgpu
from gpuguard.hw.sources import AmdgpuSource
from gpuguard.policy.power_watch import PowerWatch, poller_channels
from gpuguard.sim.host import SimHost
from gpuguard.state.hub import HostSnapshot, Hub
from gpuguard.state.snapshot import GpuSnapshot
from support import poll_until

A, B = "0000:05:00.0", "0000:08:00.0"


def snapshot(*suspended: str) -> HostSnapshot:
    return HostSnapshot(time=0, gpus=tuple(
        GpuSnapshot(name=b, bdf=b, vendor="1002", device_id="7551", driver="amdgpu", model="R9700", card=None,
                    up=True, time=0, runtime_status="suspended" if b in suspended else "active") for b in (A, B)))


def fake_poller(sim_root):
    host = SimHost.incident(seed=1, xtx=False)
    root = sim_root(host)
    src = AmdgpuSource(root)
    devs = {b: (src, SimpleNamespace(bdf=b, hwmon_path=host.hwmon_path(b))) for b in (A, B)}
    return SimpleNamespace(devices=devs, names={A: "a", B: "b"})


def test_lost_and_suspended_gpus_get_no_sampler_and_the_set_is_cached(sim_root):
    poller, hub = fake_poller(sim_root), Hub()
    channels = poller_channels(poller, hub)
    first = channels()
    assert [c.gpu for c in first] == ["a", "b"] and all(c.source == "power1_average" for c in first)
    assert channels() is first                       # nothing changed: not rebuilt
    ids = [SimpleNamespace(bdf=b, vendor="1002", device_id="7551") for b in (A, B)]
    hub.gpus.observe(ids)
    assert hub.gpus.mark_lost(A, "kernel:gpu_hang")   # lost by any route: the state owner says so
    assert [c.gpu for c in channels()] == ["b"]
    assert hub.gpus.back(A, "reset")
    hub.publish_snapshot(snapshot(B))
    assert [c.gpu for c in channels()] == ["a"]      # asleep: reading would wake it
    hub.publish_snapshot(snapshot())
    poller.names[A] = "renamed"
    assert [c.gpu for c in channels()] == ["renamed", "b"]   # in PCI order


def test_reload_changes_the_budget_and_switching_the_sampler_off_stops_threads(sim_root):
    poller, hub = fake_poller(sim_root), Hub()
    watch = PowerWatch(hub, PowerConfig(sample_hz=20), poller_channels(poller, hub))
    try:
        hp = watch.on_cycle(None)
        assert set(watch.sampler.samplers) == {"a", "b"}
        assert hp.psu_w is None and hp.limit_w is None and not hp.alerting
        watch.configure(PowerConfig(sample_hz=20, sampler=False, psu_watts=1000, margin_ratio=0.2))
        hp = watch.on_cycle(None)
        assert watch.sampler.samplers == {}
        assert hp.limit_w == 800 and hp.peak_sum_w is None      # no samples: absent, not zero
        text = "".join(str(m) for m in watch.metrics())
        assert "gpuguard_host_power_peak_watts" in text
    finally:
        watch.close()


def test_amdgpu_discovery_device_works_as_a_channel_source(sim_root, tmp_path):
    """The real discovery's device (hwmon path found by name, not number) feeds the channel."""
    from gpuguard.sim.tree import write_tree
    from gpuguard.hw.sysfs import SysfsRoot
    from gpuguard.hw.power_sources import channel_for

    host = SimHost.incident(seed=1, xtx=False)
    host.set_load(A, 1.0)
    host.step(1.0)
    write_tree(host, str(tmp_path))
    root = SysfsRoot(str(tmp_path))
    src = AmdgpuSource(root)
    (dev_a, dev_b) = amdgpu.discover(root)
    ch = channel_for(src, dev_a, "a")
    assert ch.source == "power1_average" and ch.where.startswith(dev_a.hwmon_path)
    assert ch.read() == int(host.read(f"{host.hwmon_path(A)}/power1_average")) / 1e6 > 100


def test_reload_with_a_new_rate_restarts_the_threads_and_dropping_the_budget_ends_an_alert(sim_root):
    from gpuguard.hw.power_sampler import PowerWindow

    poller, hub = fake_poller(sim_root), Hub()
    watch = PowerWatch(hub, PowerConfig(sample_hz=20, psu_watts=500, margin_ratio=0.2), poller_channels(poller, hub))
    try:
        watch.on_cycle(None)
        old = watch.sampler.samplers["a"]
        assert old.hz == 20
        hot = {"a": PowerWindow("a", A, "power1_average", 0, 1, 10, 450.0, 440.0, 300.0)}
        assert watch.budget.evaluate(hot, 1.0)[0].alerting
        watch.configure(PowerConfig(sample_hz=10))
        assert not watch.budget.alerting
        watch.on_cycle(None)
        assert watch.sampler.samplers["a"] is not old and watch.sampler.samplers["a"].hz == 10
        old.thread.join(5)
        assert not old.thread.is_alive()
    finally:
        watch.close()


def test_peaks_wandering_around_the_line_are_one_alert_cleared_only_clearly_below_for_n_intervals_in_a_row():
    """INCIDENTS §2: a loaded host's peaks wander around the alert line; each dip below it
    is not the supply out of danger. The alert is raised once and clears only after
    clear_after_seconds in a row clear_margin_ratio of the supply under the line."""
    from gpuguard.hw.power_sampler import PowerWindow
    from gpuguard.policy.psu import PsuBudget

    cfg = PowerConfig(psu_watts=1000, other_watts=0, margin_ratio=0.2, clear_margin_ratio=0.05, clear_after_seconds=3)
    budget = PsuBudget(cfg)  # alert line 800 W, clear line 750 W

    def interval(peak_w: float, t: float):
        w = PowerWindow("a", A, "power1_average", t - 1, t, 20, peak_w, peak_w, peak_w * 0.7)
        hp, events = budget.evaluate({"a": w}, t)
        return hp.alerting, [e.kind for e in events]

    t = iter(range(1, 1000))
    assert interval(820, next(t)) == (True, ["power_headroom_low"])
    # under the alert line but not under the clear line, for long: the same condition
    for peak in [790, 760, 799, 751] * 5:
        assert interval(peak, next(t)) == (True, [])
    # clearly under it, but not for 3 s (intervals of 1 s) in a row: still alerting, no new alert
    for peak in (700, 700, 780, 700, 700, 820, 700, 700):
        assert interval(peak, next(t)) == (True, [])
    assert interval(700, next(t)) == (False, ["power_headroom_ok"])  # the third in a row
    assert interval(790, next(t)) == (False, [])  # below the line: nothing to say
    assert interval(800, next(t)) == (True, ["power_headroom_low"])  # back at the line: a new condition


def capped(cap_a: float | None, cap_b: float | None) -> HostSnapshot:
    return HostSnapshot(time=0, gpus=tuple(
        GpuSnapshot(name=n, bdf=b, vendor="1002", device_id="7551", driver="amdgpu", model="R9700", card=None,
                    up=True, time=0, power_cap_watts=c) for n, b, c in (("a", A, cap_a), ("b", B, cap_b))))


def test_each_gpus_rest_line_is_its_share_of_the_cap_and_zero_keeps_the_full_rate(sim_root):
    """The sampler rests under `rest_below_ratio` of each GPU's cap (the cap the poll read
    this cycle: a profile that lowers it moves the line); a GPU with no cap known has no
    line; `rest_below_ratio: 0` never rests and a reload applies both settings."""
    poller, hub = fake_poller(sim_root), Hub()
    watch = PowerWatch(hub, PowerConfig(sample_hz=20, rest_below_ratio=0.2, rest_after_seconds=3),
                       poller_channels(poller, hub))
    try:
        watch.on_cycle(capped(300.0, None))
        s = watch.sampler
        assert s.rest_after_s == 3
        assert s.samplers["a"].rest_w == 60.0 and s.samplers["b"].rest_w is None
        watch.on_cycle(capped(210.0, 300.0))
        assert (s.samplers["a"].rest_w, s.samplers["b"].rest_w) == (42.0, 60.0)
        watch.configure(PowerConfig(sample_hz=20, rest_below_ratio=0.0))
        watch.on_cycle(capped(210.0, 300.0))
        assert watch.sampler.rest_after_s is None
        assert all(g.rest_w is None for g in watch.sampler.samplers.values())
    finally:
        watch.close()


def test_no_gpu_rests_while_the_host_peaks_are_near_the_psu_line(sim_root):
    """Cards idling under their rest lines still sum to most of a small supply: the
    sampler keeps its full rate while the host's peaks reach 80 % of the PSU line, and
    rests again once they are clear of it."""
    from gpuguard.hw.power_sampler import PowerChannel

    watts = {"a": 50.0, "b": 50.0}
    channels = [PowerChannel(g, b, "test", g, lambda g=g: watts[g]) for g, b in (("a", A), ("b", B))]
    hub = Hub()
    # line = 200 · (1 - 0.25) = 150 W; the cards' 100 W is 67 % of it: rest
    watch = PowerWatch(hub, PowerConfig(sample_hz=20, psu_watts=200, margin_ratio=0.25, rest_below_ratio=0.2),
                       lambda: channels)
    try:
        def new_samples():
            taken = {g: s.samples_total for g, s in watch.sampler.samplers.items()}   # in the last windows
            poll_until(lambda: all(s.samples_total > taken[g] for g, s in watch.sampler.samplers.items()),
                       timeout=10, what="a new sample of each")

        watch.on_cycle(capped(300.0, 300.0))
        new_samples()
        hp = watch.on_cycle(capped(300.0, 300.0))
        assert hp.host_peak_w == 100.0
        assert {g: s.rest_w for g, s in watch.sampler.samplers.items()} == {"a": 60.0, "b": 60.0}
        watch.configure(PowerConfig(sample_hz=20, psu_watts=160, margin_ratio=0.25, rest_below_ratio=0.2))
        new_samples()
        hp = watch.on_cycle(capped(300.0, 300.0))   # line 120 W: 100 W is 83 % of it
        assert hp.limit_w == 120.0
        assert all(s.rest_w is None for s in watch.sampler.samplers.values())
    finally:
        watch.close()


class _Replay:
    """The sampler's side of PowerWatch replayed from a time series: each poll cycle's
    window holds the samples a 20 Hz sampler would have read of `watts(t)` since the last."""

    HZ = 20

    def __init__(self, watts, clock) -> None:
        self.watts, self.clock, self.last = watts, clock, 0.0
        self.rest_lines: dict = {}
        self.samplers: dict = {}

    def sync(self, channels) -> None:
        pass

    def set_rest_lines(self, lines) -> None:
        self.rest_lines = dict(lines)

    def take_windows(self):
        from gpuguard.hw.power_sampler import PowerWindow

        start, end = self.last, self.clock.t
        self.last = end
        n = round((end - start) * self.HZ)
        out = {}
        for gpu, bdf in (("r9700-a", A), ("r9700-b", B)):
            ws = [self.watts(start + (i + 1) / self.HZ) for i in range(n)]
            out[gpu] = PowerWindow(gpu, bdf, "power1_average", start, end, n, max(ws), max(ws), sum(ws) / n)
        return out

    def burst(self, gpu, since=None):
        return []

    def close(self) -> None:
        pass


def _r9700_pair_at_full_load(t: float) -> float:
    """One R9700's fast-sampled power (W): two at stock under full load for 47 s, peaks
    around the host's alert line (INCIDENTS §2: 249–289 W per card), with 3-second lulls
    under the clear line between batches; then idle."""
    if t >= 47:
        return 60.0
    if any(a <= t < a + 3 for a in (10, 24, 37)):
        return 215.0  # both cards: 430 + 450 W = 880 W, under the 910 W clear line
    return 289.0 if int(t * 20) % 4 == 0 else 255.0  # peaks 1028 W against the 975 W line


@pytest.mark.parametrize("interval", [0.5, 1.0, 2.0])
def test_psu_alert_hysteresis_is_in_seconds_whatever_the_poll_interval(interval):
    """Two R9700 at stock, full load for 47 s with lulls of 3 s, polled every 0.5, 1 or 2 s:
    one power_headroom_low episode each (at 0.5 s the hysteresis counted 5 intervals =
    2.5 s: three episodes), and the all-clear 5 s after the load ends, within one interval."""
    clock = SimpleNamespace(t=0.0)
    hub = Hub()
    events: list = []
    hub.on_event(events.append)
    cfg = PowerConfig(sampler=False, psu_watts=1300, other_watts=450, margin_ratio=0.25)  # default hysteresis
    watch = PowerWatch(hub, cfg, lambda: [], sampler=_Replay(_r9700_pair_at_full_load, clock), wall=lambda: clock.t)
    try:
        for i in range(1, round(70 / interval) + 1):
            clock.t = i * interval
            watch.on_cycle(None)
    finally:
        watch.close()
    kinds = [(e.kind, e.time) for e in events if e.kind.startswith("power_headroom")]
    assert [k for k, _ in kinds] == ["power_headroom_low", "power_headroom_ok"], kinds
    cleared = kinds[1][1]
    assert 47 + 5 <= cleared <= 47 + 5 + interval, kinds

"""Time nobody watched (engines/lapses.py) with injected clocks, and the stall state machine
fed an observation after such a gap: the clock restarts there, and a real stall is still
declared stall_after later. The daemon SIGSTOPped for real: tests/daemon/test_engine_watch_gap.py."""
from __future__ import annotations

import asyncio

from gpuguard.engines.lapses import Lapses
from gpuguard.engines.stall import Observation

from test_stall import R, ready_at, tracker


class Clocks:
    def __init__(self) -> None:
        self.mono, self.boot = 1000.0, 5000.0

    def run(self, seconds: float) -> None:  # the host runs: both clocks move
        self.mono += seconds
        self.boot += seconds

    def suspend(self, seconds: float) -> None:  # CLOCK_MONOTONIC stops, CLOCK_BOOTTIME does not
        self.boot += seconds


def lapses(clocks: Clocks, watching: bool = True) -> Lapses:
    la = Lapses(tick=0.25, least=2.0, monotonic=lambda: clocks.mono, boot=lambda: clocks.boot)
    la.watching = watching
    return la


def test_ticks_on_time_and_scheduling_noise_are_not_a_lapse():
    c = Clocks()
    la = lapses(c)
    for late in (0.0, 0.1, 0.0, 1.5, 0.3):  # a loaded host's late wakes, under `least`
        c.run(0.25 + late)
        assert la.note() == 0.0
    assert la.total == 0.0 and la.count == 0


def test_the_daemon_stopped_is_the_time_past_its_tick():
    c = Clocks()
    la = lapses(c)
    c.run(0.25)
    la.note()
    c.run(6.25)  # SIGSTOP for 6 s between two ticks
    assert la.note() == 6.0
    assert la.total == 6.0 and la.count == 1 and la.last == {"seconds": 6.0, "late": 6.0, "suspended": 0.0}
    c.run(0.25)
    assert la.note() == 0.0  # counted once


def test_a_suspend_is_boottime_running_ahead_of_monotonic_even_without_the_ticker():
    c = Clocks()
    la = lapses(c, watching=False)  # polls driven one by one: lateness means nothing
    c.run(30.0)
    assert la.note() == 0.0
    c.run(0.1)
    c.suspend(172.0)
    assert la.note() == 172.0 and la.last["suspended"] == 172.0 and la.last["late"] == 0.0


def test_the_ticker_watches_only_while_it_runs():
    la = Lapses(tick=0.01)

    async def scenario():
        task = asyncio.create_task(la.run())
        await asyncio.sleep(0.05)
        assert la.watching
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert not la.watching


def test_the_stall_clock_restarts_at_the_first_observation_after_a_gap():
    tr = tracker(stall_after=3.0)
    ready_at(tr, 100.0, R(1, 0, hb=10))
    ready_at(tr, 100.5, R(1, 0, hb=20))  # last movement seen at 100.5
    # the daemon did not run from 100.5 to 106.5: the heartbeat reads the same after it
    v = tr.observe(Observation(106.5, 10, 0.0, "ready", R(1, 0, hb=20), unobserved=6.0))
    assert not v.stalled and v.state == "busy" and v.no_progress_seconds == 0.0
    assert v.evidence["unobserved_seconds"] == 6.0
    v = ready_at(tr, 109.0, R(1, 0, hb=20))
    assert not v.stalled and v.no_progress_seconds == 2.5
    v = ready_at(tr, 109.5, R(1, 0, hb=20))  # a real stall, judged from the poll after the gap
    assert v.stalled and v.reason == "heartbeat_flat" and v.no_progress_seconds == 3.0


def test_failing_health_and_an_unanswered_metrics_restart_too():
    tr = tracker(stall_after=3.0, unhealthy_after=2.0)
    ready_at(tr, 100.0, R(0, 0, hb=5))
    tr.observe(Observation(100.5, 10, 0.0, "timeout", None, "timeout"))  # not answering since 100.5
    v = tr.observe(Observation(110.0, 10, 0.0, "timeout", None, "timeout", unobserved=9.0))
    assert not v.stalled and v.state == "unresponsive" and v.evidence["health_failing_seconds"] == 0.0
    v = tr.observe(Observation(112.0, 10, 0.0, "timeout", None, "timeout"))
    assert v.state == "unhealthy" and v.reason == "health_failing"


def test_time_unobserved_while_starting_does_not_count_toward_the_ready_timeout():
    tr = tracker(ready_timeout=10.0)
    assert tr.observe(Observation(100.0, 10, 99.0, "starting")).state == "starting"
    v = tr.observe(Observation(112.0, 10, 99.0, "starting", unobserved=8.0))  # 13 s since start, 8 unobserved
    assert v.state == "starting"
    v = tr.observe(Observation(117.0, 10, 99.0, "starting"))  # 18 - 8 = 10 s watched
    assert v.state == "unhealthy" and v.reason == "ready_timeout"

"""Whole verdicts of the stall state machine, every field and every evidence key, along
scripted lives of an engine: starting to ready (time to ready), busy to a flat heartbeat,
CPU spin, metrics unanswered, health failing, restarts and new PIDs, ready timeouts, the
decode gap, the measured prefill rate and the batch bound. Times carry four decimals so a
rounding to the wrong digit shows. bench/mutation.sh found these fields unobserved."""
from __future__ import annotations

import pytest

from gpuguard.engines.adapters import EngineReading
from gpuguard.engines.config import EngineConfig
from gpuguard.engines.stall import BATCH_NOTE, Observation as O, StallSettings, StallTracker


def R(running=0, waiting=0, hb=0.0, tokens=None, decode=None, prefill=None, live=None, prefill_seconds=None):
    return EngineReading(running, waiting, hb, tokens if tokens is not None else hb, decode, prefill,
                         prefill_seconds, live if live is not None else hb)


NO_BATCH = {"tokens": None, "prefill_rate_tokens_per_second": None, "rate_from": None, "bound_seconds": 0.0,
            "applies": False, "why_not": "no prefill rate measured yet"}


def full(v) -> dict:
    d = {k: getattr(v, k) for k in ("state", "stalled", "reason", "no_progress_seconds", "decode_gap_seconds",
                                     "tokens_per_second", "cpu_percent", "step_seconds", "stall_window",
                                     "time_to_ready", "new_pid", "became_ready", "reading")}
    d["evidence"] = dict(v.evidence)
    return d


def before_running(window: float, health, **top) -> dict:
    """The verdict of a poll before the engine runs (down, starting, a ready timeout)."""
    ev = {"health": health, "metrics_error": None, "running": None, "waiting": None, "heartbeat": None,
          "tokens": None, "no_progress_seconds": 0.0, "stall_window_seconds": window, "step_seconds": None,
          "cpu_percent": None, "cpu_seconds": None}
    return {"state": "starting", "stalled": False, "reason": None, "no_progress_seconds": 0.0,
            "decode_gap_seconds": None, "tokens_per_second": None, "cpu_percent": None, "step_seconds": None,
            "stall_window": window, "time_to_ready": None, "new_pid": False, "became_ready": False, "reading": None,
            **top, "evidence": ev}


def running(window: float, reading: EngineReading | None, ev: dict | None = None, **top) -> dict:
    """The verdict of a running engine's poll; `ev` overrides evidence keys."""
    r = reading
    evidence = {"health": "ready", "metrics_error": None, "running": r and r.running, "waiting": r and r.waiting,
                "heartbeat": r and r.heartbeat, "tokens": r and r.tokens, "no_progress_seconds": 0.0,
                "stall_window_seconds": window, "step_seconds": None, "cpu_percent": None, "cpu_seconds": None,
                "heartbeat_flat_seconds": 0.0, "progress_flat_seconds": 0.0, "step_window_seconds": window,
                "prefill_batch": NO_BATCH, "process_state": None, "cpu_pinned_seconds": None,
                "metrics_unanswered_seconds": None, "health_failing_seconds": None, **(ev or {})}
    if r is None:
        evidence.update(running=None, waiting=None, heartbeat=None, tokens=None)
    return {"state": "busy", "stalled": False, "reason": None, "no_progress_seconds": 0.0,
            "decode_gap_seconds": None, "tokens_per_second": None, "cpu_percent": None, "step_seconds": None,
            "stall_window": window, "time_to_ready": None, "new_pid": False, "became_ready": False, "reading": r,
            **top, "evidence": evidence}


# ------------------------------------------------------------------ before running


def test_down_and_starting_verdicts():
    tr = StallTracker(StallSettings(stall_after=7.5))
    assert full(tr.observe(O(10.0, None))) == before_running(7.5, None, state="down")
    assert full(tr.observe(O(11.0, 42, 10.5, "starting"))) == before_running(7.5, "starting", new_pid=True)
    assert full(tr.observe(O(12.0, None, None, "refused"))) == before_running(7.5, "refused", state="down")


def test_ready_timeout_is_measured_from_the_pids_own_start():
    tr = StallTracker(StallSettings(ready_timeout=30.0))
    assert full(tr.observe(O(129.9, 7, 100.0, "starting"))) == before_running(60.0, "starting")
    assert full(tr.observe(O(130.0, 7, 100.0, "timeout"))) == before_running(
        60.0, "timeout", state="unhealthy", reason="ready_timeout")


def test_without_a_start_time_there_is_no_ready_timeout():
    tr = StallTracker(StallSettings(ready_timeout=30.0))
    assert tr.observe(O(10_000.0, 7, None, "starting")).state == "starting"


# ------------------------------------------------------------------ a life: ready, busy, stalled


def test_from_start_to_ready_to_busy_to_a_flat_heartbeat():
    tr = StallTracker(StallSettings(stall_after=10.0, step_multiple=4.0, floor=2.0, jitter=0.1))
    assert full(tr.observe(O(5.0, 10, 1.0, "starting"))) == before_running(10.0, "starting")
    r0 = R(0, 0, hb=0)
    v = tr.observe(O(8.5, 10, 1.0, "ready", r0, None, 1000.0, "S"))
    assert full(v) == running(10.0, r0, {"cpu_seconds": 1000.0, "process_state": "S"}, state="idle",
                              time_to_ready=7.5, became_ready=True)
    r1 = R(2, 1, hb=10, live=100)
    v = tr.observe(O(10.5, 10, 1.0, "ready", r1, None, 1001.0, "R"))
    assert full(v) == running(10.0, r1, {"cpu_seconds": 1001.0, "process_state": "R", "cpu_percent": 50.0},
                              time_to_ready=7.5, tokens_per_second=50.0, cpu_percent=50.0)
    r2 = R(2, 1, hb=30, live=300)
    v = tr.observe(O(12.5, 10, 1.0, "ready", r2, None, 1002.9, "R"))
    # 20 steps in 2 s: 0.1 s a step; 4 x 0.1 is under the 2 s floor; CPU 95 % since the poll at 10.5
    assert full(v) == running(2.0, r2, {"cpu_seconds": 1002.9, "process_state": "R", "cpu_percent": 95.0,
                                        "step_seconds": 0.1, "cpu_pinned_seconds": 2.0},
                              time_to_ready=7.5, tokens_per_second=100.0, cpu_percent=pytest.approx(95.0),
                              step_seconds=0.1)
    v = tr.observe(O(14.4, 10, 1.0, "ready", r2, None, 1004.8, "R"))
    assert full(v) == running(2.0, r2, {"cpu_seconds": 1004.8, "process_state": "R", "cpu_percent": 100.0,
                                        "step_seconds": 0.1, "cpu_pinned_seconds": 3.9, "no_progress_seconds": 1.9,
                                        "heartbeat_flat_seconds": 1.9, "progress_flat_seconds": 1.9},
                              time_to_ready=7.5, tokens_per_second=0.0, cpu_percent=pytest.approx(100.0),
                              step_seconds=0.1, no_progress_seconds=pytest.approx(1.9), state="stalled",
                              stalled=True, reason="heartbeat_flat")
    # /metrics stops answering: the last reading stands, no rate, the heartbeat counts as flat
    v = tr.observe(O(16.5123, 10, 1.0, "ready", None, "timeout", 1006.0, "R"))
    assert full(v) == running(2.0, r2, {"cpu_seconds": 1006.0, "process_state": "R", "cpu_percent": 56.8,
                                        "step_seconds": 0.1, "no_progress_seconds": 4.012, "metrics_error": "timeout",
                                        "heartbeat_flat_seconds": 4.012, "progress_flat_seconds": 4.012,
                                        "metrics_unanswered_seconds": 0.0},
                              time_to_ready=7.5, cpu_percent=pytest.approx(56.81, abs=0.005), step_seconds=0.1,
                              no_progress_seconds=pytest.approx(4.0123), state="stalled", stalled=True,
                              reason="heartbeat_flat")


def test_the_first_sight_of_an_engine_already_ready_measures_no_time_to_ready():
    tr = StallTracker(StallSettings())
    v = tr.observe(O(50.0, 10, 1.0, "ready", R()))
    assert (v.state, v.time_to_ready, v.became_ready, v.new_pid) == ("idle", None, True, False)
    v = tr.observe(O(52.0, 10, 1.0, "ready", R()))
    assert (v.became_ready, v.new_pid) == (False, False)


def test_ready_at_once_after_start_is_a_time_to_ready_under_a_second():
    tr = StallTracker(StallSettings())
    tr.observe(O(10.0, 10, 10.0, "starting"))
    assert tr.observe(O(10.25, 10, 10.0, "ready", R())).time_to_ready == 0.25


def test_ready_without_metrics_then_work():
    tr = StallTracker(StallSettings(stall_after=5.0))
    v = tr.observe(O(10.0, 7, 9.5, "ready", None, "refused"))
    assert full(v) == running(5.0, None, {"metrics_error": "refused", "metrics_unanswered_seconds": 0.0},
                              state="ready", became_ready=True)
    v = tr.observe(O(13.1234, 7, 9.5, "ready", None, "refused"))
    assert full(v) == running(5.0, None, {"metrics_error": "refused", "metrics_unanswered_seconds": 3.123,
                                          "heartbeat_flat_seconds": 3.123, "progress_flat_seconds": 3.123},
                              state="ready")
    r = R(1, 0, hb=5, decode=5)
    v = tr.observe(O(15.0, 7, 9.5, "ready", r))
    # work measured from the last poll seen without any (13.1234), not from ready (10)
    assert full(v) == running(5.0, r, {"no_progress_seconds": 1.877, "heartbeat_flat_seconds": 5.0,
                                       "progress_flat_seconds": 5.0},
                              no_progress_seconds=pytest.approx(1.8766))
    v = tr.observe(O(15.0123, 7, 9.5, "ready", None, "refused"))
    assert v.evidence["metrics_unanswered_seconds"] == 0.0 and v.state == "busy"
    v = tr.observe(O(20.0124, 7, 9.5, "ready", None, "refused"))
    assert (v.state, v.reason, v.evidence["metrics_unanswered_seconds"]) == ("stalled", "heartbeat_flat", 5.0)


def test_metrics_unanswered_while_health_is_ready_at_the_window():
    tr = StallTracker(StallSettings(stall_after=4.0))
    tr.observe(O(10.0, 7, 1.0, "ready", R(0, 0, hb=1)))
    tr.observe(O(11.0, 7, 1.0, "ready", None, "timeout"))
    assert tr.observe(O(14.9999, 7, 1.0, "ready", None, "timeout")).reason is None
    v = tr.observe(O(15.0, 7, 1.0, "ready", None, "timeout"))
    assert (v.state, v.reason, v.evidence["metrics_unanswered_seconds"]) == ("stalled", "metrics_unanswered", 4.0)


def test_unanswered_health_and_metrics_are_unresponsive():
    tr = StallTracker(StallSettings(stall_after=30.0, unhealthy_after=10.0))
    tr.observe(O(10.0, 7, 1.0, "ready", R(0, 0, hb=1)))
    for health in ("timeout", "refused", "error"):
        v = tr.observe(O(11.0, 7, 1.0, health, None, health))
        assert (v.state, v.tokens_per_second, v.evidence["health_failing_seconds"]) == ("unresponsive", None, 0.0)
    v = tr.observe(O(12.5, 7, 1.0, "failed", R(0, 0, hb=1)))
    assert (v.state, v.evidence["health_failing_seconds"]) == ("idle", 1.5)


def test_health_failing_counts_only_without_progress_since_it_began():
    tr = StallTracker(StallSettings(stall_after=60.0, unhealthy_after=10.0))
    tr.observe(O(10.0, 7, 1.0, "ready", R(1, 0, hb=1)))
    tr.observe(O(12.0, 7, 1.0, "failed", R(1, 0, hb=2)))  # progress at the very poll health began failing
    v = tr.observe(O(22.0, 7, 1.0, "failed", R(1, 0, hb=2)))
    assert (v.state, v.reason, v.evidence["health_failing_seconds"]) == ("unhealthy", "health_failing", 10.0)
    tr.observe(O(23.0, 7, 1.0, "failed", R(1, 0, hb=3)))  # progress after it began: alive
    assert tr.observe(O(40.0, 7, 1.0, "failed", R(1, 0, hb=3))).state == "busy"


# ------------------------------------------------------------------ CPU


def test_cpu_pinned_at_exactly_the_busy_ratio_is_a_spin_at_the_window():
    tr = StallTracker(StallSettings(stall_after=20.0, cpu_busy_ratio=0.9))
    tr.observe(O(100.0, 7, 1.0, "ready", R(0, 0, hb=1), None, 5000.0))
    v = tr.observe(O(110.0, 7, 1.0, "ready", R(0, 0, hb=1), None, 5009.0))  # 9 s of CPU in 10 s: 90 %
    assert (v.cpu_percent, v.evidence["cpu_pinned_seconds"]) == (pytest.approx(90.0), 10.0)
    assert v.reason is None
    v = tr.observe(O(120.0, 7, 1.0, "ready", R(0, 0, hb=1), None, 5018.0))
    assert (v.state, v.reason, v.evidence["cpu_pinned_seconds"]) == ("stalled", "cpu_spin", 20.0)


def test_half_a_core_is_not_pinned_and_idle_cpu_is_zero():
    tr = StallTracker(StallSettings(cpu_busy_ratio=0.9))
    tr.observe(O(100.0, 7, 1.0, "ready", R(), None, 5000.0))
    v = tr.observe(O(110.0, 7, 1.0, "ready", R(), None, 5005.0))
    assert (v.cpu_percent, v.evidence["cpu_pinned_seconds"]) == (50.0, None)
    v = tr.observe(O(120.0, 7, 1.0, "ready", R(), None, 5005.0))
    assert (v.cpu_percent, v.evidence["cpu_percent"]) == (0.0, 0.0)
    v = tr.observe(O(120.0, 7, 1.0, "ready", R(), None, 5005.0))  # the same instant again: no rate from it
    assert v.cpu_percent == 0.0


def test_cpu_spin_needs_the_heartbeat_flat_for_the_window_too():
    tr = StallTracker(StallSettings(stall_after=20.0))
    tr.observe(O(100.0, 7, 1.0, "ready", R(0, 0, hb=1), None, 0.0))
    tr.observe(O(105.0, 7, 1.0, "ready", R(0, 0, hb=2), None, 5.0))  # pinned from 100, progress at 105
    v = tr.observe(O(124.9, 7, 1.0, "ready", R(0, 0, hb=2), None, 24.9))
    assert v.reason is None and v.evidence["heartbeat_flat_seconds"] == 19.9
    v = tr.observe(O(125.0, 7, 1.0, "ready", R(0, 0, hb=2), None, 25.0))
    assert v.reason == "cpu_spin"


# ------------------------------------------------------------------ steps and rates


def test_step_time_is_a_moving_average():
    tr = StallTracker(StallSettings(stall_after=60.0, step_multiple=10.0, floor=1.0))
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0)))
    assert tr.observe(O(2.0, 7, None, "ready", R(1, 0, hb=4))).step_seconds == 0.5
    v = tr.observe(O(4.0, 7, None, "ready", R(1, 0, hb=5)))  # 2 s for one step: 0.7 x 0.5 + 0.3 x 2
    assert v.step_seconds == pytest.approx(0.95) and v.stall_window == pytest.approx(9.5)
    v = tr.observe(O(6.0, 7, None, "ready", R(0, 0, hb=4)))  # the counter went back: no step from that
    assert v.step_seconds == pytest.approx(0.95)
    v = tr.observe(O(8.0, 7, None, "ready", R(0, 0, hb=6)))  # steps while nothing was pending: not timed
    assert v.step_seconds == pytest.approx(0.95)


def test_a_heartbeat_that_appears_later_is_timed_from_then():
    tr = StallTracker(StallSettings())
    tr.observe(O(0.0, 7, None, "ready", EngineReading(1, 0, None, None, None, None)))
    v = tr.observe(O(1.0, 7, None, "ready", R(1, 0, hb=10)))
    assert v.step_seconds is None
    assert tr.observe(O(3.0, 7, None, "ready", R(1, 0, hb=14))).step_seconds == 0.5


def test_token_rate_needs_two_answered_scrapes_at_different_times():
    tr = StallTracker(StallSettings())
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=1, live=100)))
    assert tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=2, live=150))).tokens_per_second is None
    assert tr.observe(O(2.0, 7, None, "ready", R(1, 0, hb=3, live=150))).tokens_per_second == 0.0
    assert tr.observe(O(4.0, 7, None, "ready", R(1, 0, hb=4, live=100))).tokens_per_second is None  # reset
    v = tr.observe(O(6.0, 7, None, "ready", EngineReading(1, 0, 5, 5, None, None, None, None)))
    assert v.tokens_per_second is None  # the engine gives no live token count


# ------------------------------------------------------------------ restarts


def test_a_restart_waits_for_a_new_pid_and_times_its_start():
    tr = StallTracker(StallSettings(stall_after=5.0))
    tr.observe(O(10.0, 10, 1.0, "ready", R(1, 0, hb=1)))
    tr.mark_starting()
    v = tr.observe(O(11.0, 10, 1.0, "ready", R(1, 0, hb=1)))  # the old process, still exiting
    assert full(v) == before_running(5.0, "ready")
    v = tr.observe(O(12.0, 11, 11.5, "ready", R(0, 0, hb=0)))  # the new one, ready at first sight
    assert (v.state, v.new_pid, v.became_ready, v.time_to_ready) == ("idle", True, True, 0.5)
    v = tr.observe(O(13.0, 11, 11.5, "ready", R(0, 0, hb=0)))
    assert (v.new_pid, v.became_ready) == (False, False)


def test_a_new_pid_seen_starting_is_new_once():
    tr = StallTracker(StallSettings())
    tr.observe(O(10.0, 10, 1.0, "ready", R()))
    tr.mark_starting()
    v = tr.observe(O(12.0, 11, 11.0, "starting"))
    assert (v.state, v.new_pid) == ("starting", True)
    v = tr.observe(O(14.0, 11, 11.0, "ready", R()))
    assert (v.new_pid, v.became_ready, v.time_to_ready) == (False, True, 3.0)


def test_a_pid_change_without_a_restart_is_new_and_goes_down_on_no_pid():
    tr = StallTracker(StallSettings())
    tr.observe(O(10.0, 10, 1.0, "ready", R()))
    v = tr.observe(O(11.0, 12, 10.75, "ready", R()))
    assert (v.new_pid, v.became_ready, v.time_to_ready) == (True, True, 0.25)
    v = tr.observe(O(12.0, None))
    assert (v.state, v.new_pid, v.reading) == ("down", False, None)


# ------------------------------------------------------------------ decode gap


def test_decode_gap_from_when_decode_work_resumed():
    tr = StallTracker(StallSettings(stall_after=600.0), separates_decode=True)
    tr.observe(O(0.0, 7, None, "ready", R(0, 1, hb=0, decode=0)))  # waiting only: no decode work
    v = tr.observe(O(10.0, 7, None, "ready", R(0, 1, hb=1, decode=0)))
    assert v.decode_gap_seconds == 0.0
    tr.observe(O(11.0, 7, None, "ready", R(1, 0, hb=2, decode=0)))  # decode work from here on
    v = tr.observe(O(14.5, 7, None, "ready", R(1, 0, hb=3, decode=0)))
    assert v.decode_gap_seconds == 4.5  # since 10.0, the last poll without decode work
    v = tr.observe(O(15.0, 7, None, "ready", R(1, 0, hb=4, decode=1)))  # decode moved: the gap closed
    assert v.decode_gap_seconds == 5.0  # from 10.0 to 15.0, the first poll that saw decode again
    v = tr.observe(O(315.0, 7, None, "ready", R(1, 0, hb=5, decode=2)))
    assert v.decode_gap_seconds == 5.0  # closed at 15, exactly the window ago: still counted
    v = tr.observe(O(315.5, 7, None, "ready", R(1, 0, hb=6, decode=2)))
    assert v.decode_gap_seconds == 0.5  # it has left the window; the current gap is all there is


def test_a_closed_gap_counts_for_the_window_and_a_short_one_too():
    tr = StallTracker(StallSettings(stall_after=600.0), separates_decode=True)
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0, decode=0)))
    tr.observe(O(0.75, 7, None, "ready", R(1, 0, hb=1, decode=0)))
    tr.observe(O(1.0, 7, None, "ready", R(1, 0, hb=2, decode=1)))  # a gap from 0.0 closed at 1.0
    v = tr.observe(O(1.5, 7, None, "ready", R(1, 0, hb=3, decode=2)))
    assert v.decode_gap_seconds == 1.0
    v = tr.observe(O(301.0, 7, None, "ready", R(0, 0, hb=3, decode=2)))  # closed exactly 300 s ago: still in
    assert v.decode_gap_seconds == 1.0
    v = tr.observe(O(301.5, 7, None, "ready", R(0, 0, hb=3, decode=2)))
    assert v.decode_gap_seconds == 0.0  # the 1.0 s gap has left the window


def test_decode_gap_before_the_first_decode_reading_counts_from_ready():
    tr = StallTracker(StallSettings(stall_after=600.0), separates_decode=True)
    tr.observe(O(8.0, 7, None, "ready", None, "refused"))
    tr.observe(O(10.0, 7, None, "ready", R(1, 0, hb=1, decode=5)))
    assert tr.observe(O(14.0, 7, None, "ready", R(1, 0, hb=2, decode=5))).decode_gap_seconds == 6.0


def test_no_decode_gap_without_a_decode_counter():
    tr = StallTracker(StallSettings())  # the engine has no decode counter
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0, decode=0)))
    assert tr.observe(O(5.0, 7, None, "ready", R(1, 0, hb=1, decode=0))).decode_gap_seconds is None
    tr = StallTracker(StallSettings(), separates_decode=True)
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0)))  # ... or one that exports no decode value
    assert tr.observe(O(5.0, 7, None, "ready", R(1, 0, hb=1))).decode_gap_seconds is None


# ------------------------------------------------------------------ prefill rate, batch bound


def test_batch_bound_at_the_engines_own_prefill_rate():
    tr = StallTracker(StallSettings(stall_after=10.0, prefill_margin=2.0, prefill_ceiling=300.0))
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0, prefill=0, prefill_seconds=0.0), cpu_seconds=0.0,
                 batch_tokens=100))
    r = R(1, 0, hb=0, prefill=300, prefill_seconds=100.0)  # 3 tokens/s: 100 tokens take 33.3 s, x2 = 66.667
    v = tr.observe(O(1.0, 7, None, "ready", r, cpu_seconds=1.0, batch_tokens=100))
    batch = {"tokens": 100, "prefill_rate_tokens_per_second": 3.0, "rate_from": "engine", "bound_seconds": 66.667,
             "applies": True, "note": BATCH_NOTE}
    assert v.evidence["prefill_batch"] == batch
    assert (v.stall_window, v.evidence["stall_window_seconds"], v.evidence["step_window_seconds"]) == (66.667, 66.667, 10.0)
    # a later interval by scrapes cannot talk the engine's figure down
    r2 = R(1, 0, hb=0, prefill=600, prefill_seconds=100.0)
    v = tr.observe(O(2.0, 7, None, "ready", r2, cpu_seconds=2.0, batch_tokens=100))
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] == 3.0
    # prompt seconds moving without prompt tokens: not a new figure
    r3 = R(1, 0, hb=0, prefill=600, prefill_seconds=150.0)
    v = tr.observe(O(3.0, 7, None, "ready", r3, cpu_seconds=3.0, batch_tokens=100))
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] == 3.0


def test_batch_bound_from_scrapes_needs_a_quarter_batch():
    tr = StallTracker(StallSettings(stall_after=10.0, prefill_ceiling=1000.0))
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0, prefill=0), batch_tokens=1000))
    v = tr.observe(O(4.0, 7, None, "ready", R(1, 0, hb=0, prefill=249), batch_tokens=1000))  # under a quarter
    assert v.evidence["prefill_batch"] == NO_BATCH | {"tokens": 1000}
    v = tr.observe(O(8.0, 7, None, "ready", R(1, 0, hb=0, prefill=499), batch_tokens=1000))  # 250 in 4 s
    assert v.evidence["prefill_batch"] == {"tokens": 1000, "prefill_rate_tokens_per_second": 62.5,
                                           "rate_from": "scrapes", "bound_seconds": 32.0, "applies": True,
                                           "note": BATCH_NOTE}
    v = tr.observe(O(8.0, 7, None, "ready", R(1, 0, hb=0, prefill=999), batch_tokens=1000))  # no time passed
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] == 62.5
    v = tr.observe(O(11.0, 7, None, "ready", R(1, 0, hb=0, prefill=1999), batch_tokens=1000))  # faster: taken
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] == 333.3


def test_a_slow_first_rate_is_taken_as_it_is():
    tr = StallTracker(StallSettings(stall_after=10.0, prefill_ceiling=1000.0))
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0, prefill=0), batch_tokens=4))
    v = tr.observe(O(4.0, 7, None, "ready", R(1, 0, hb=0, prefill=1), batch_tokens=4))  # 0.25 tokens/s
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] == 0.2  # 0.25 to one decimal
    assert v.evidence["prefill_batch"]["bound_seconds"] == 32.0


def test_batch_size_unknown_and_the_reasons_no_stretch_applies():
    tr = StallTracker(StallSettings(stall_after=10.0))
    tr.observe(O(0.0, 7, None, "ready", R(1, 0, hb=0, prefill=0, prefill_seconds=0.0), cpu_seconds=0.0))
    v = tr.observe(O(1.0, 7, None, "ready", R(1, 0, hb=0, prefill=300, prefill_seconds=1.0), cpu_seconds=1.0))
    assert v.evidence["prefill_batch"] == {"tokens": None, "prefill_rate_tokens_per_second": 300.0,
                                           "rate_from": "engine", "bound_seconds": 0.0, "applies": False,
                                           "why_not": "batch size unknown"}
    v = tr.observe(O(2.0, 7, None, "ready", R(1, 0, hb=0, prefill=300, prefill_seconds=1.0), cpu_seconds=1.0,
                     batch_tokens=3000))
    assert v.evidence["prefill_batch"] | {"note": None} == {
        "tokens": 3000, "prefill_rate_tokens_per_second": 300.0, "rate_from": "engine", "bound_seconds": 20.0,
        "applies": False, "why_not": "the GPU process used no CPU since the last poll", "note": None}
    assert v.stall_window == 10.0
    v = tr.observe(O(3.0, 7, None, "ready", R(1, 0, hb=0, prefill=300, prefill_seconds=1.0), cpu_seconds=2.0,
                     process_state="T", batch_tokens=3000))
    assert v.evidence["prefill_batch"]["why_not"] == "process state T: it cannot be working"


# ------------------------------------------------------------------ settings


def test_settings_from_the_engine_config():
    cfg = EngineConfig.model_validate({"name": "e", "kind": "vllm", "url": "http://127.0.0.1:1", "process": {"cmdline": "vllm"},
                                       "poll_interval": 2.5,
                                       "stall_after": 70.0, "stall_step_multiple": 8.0, "stall_floor": 6.0,
                                       "cpu_busy_ratio": 0.8, "unhealthy_after": 40.0, "ready_timeout": 500.0,
                                       "prefill_margin": 3.0, "prefill_ceiling": 200.0})
    assert StallSettings.from_config(cfg) == StallSettings(70.0, 8.0, 6.0, 0.8, 40.0, 500.0, jitter=0.25,
                                                           prefill_margin=3.0, prefill_ceiling=200.0)


def test_cpu_spin_is_timed_from_when_the_cpu_got_pinned_not_from_the_flat_heartbeat():
    tr = StallTracker(StallSettings(stall_after=20.0))
    tr.observe(O(100.0, 7, 1.0, "ready", R(0, 0, hb=1), None, 0.0))
    tr.observe(O(200.0, 7, 1.0, "ready", R(0, 0, hb=1), None, 1.0))  # a long quiet while: heartbeat flat
    v = tr.observe(O(210.0004, 7, 1.0, "ready", R(0, 0, hb=1), None, 11.0004))  # pinned since 200
    assert (v.reason, v.evidence["cpu_pinned_seconds"], v.evidence["heartbeat_flat_seconds"]) == (None, 10.0, 110.0)  # to the millisecond
    assert tr.observe(O(220.0, 7, 1.0, "ready", R(0, 0, hb=1), None, 21.0)).reason == "cpu_spin"


def test_health_failing_seconds_to_the_millisecond():
    tr = StallTracker(StallSettings(unhealthy_after=100.0))
    tr.observe(O(100.0, 7, 1.0, "ready", R()))
    tr.observe(O(101.0, 7, 1.0, "failed", R()))
    assert tr.observe(O(103.2346, 7, 1.0, "failed", R())).evidence["health_failing_seconds"] == 2.235

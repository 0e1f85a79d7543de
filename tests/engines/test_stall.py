"""The stall state machine, with explicit timestamps: every rule fires exactly at its
window and not before; idle, busy and slow-but-progressing engines never stall."""
from __future__ import annotations

from gpuguard.engines.adapters import EngineReading
from gpuguard.engines.stall import Observation, StallSettings, StallTracker


def R(running=0, waiting=0, hb=0.0, tokens=None, decode=None, prefill=None, live=None, prefill_seconds=None):
    """A scrape; live tokens (the rate's source) move with the step counter unless given."""
    return EngineReading(running, waiting, hb, tokens if tokens is not None else hb, decode, prefill,
                         prefill_seconds, live if live is not None else hb)


def tracker(**kw):
    return StallTracker(StallSettings(**{"stall_after": 2.0, **kw}))


def ready_at(tr, t, reading, pid=10, cpu=None):
    return tr.observe(Observation(t, pid, 0.0, "ready", reading, None, cpu))


def test_idle_engine_never_stalls():
    tr = tracker()
    for i in range(100):
        v = ready_at(tr, 100 + i, R(0, 0, hb=5))
        assert v.state == "idle" and not v.stalled and v.no_progress_seconds == 0


def test_busy_engine_producing_never_stalls():
    tr = tracker()
    for i in range(50):
        v = ready_at(tr, 100 + i * 0.5, R(2, 1, hb=i * 40))
        assert not v.stalled
    assert v.state == "busy" and abs(v.tokens_per_second - 80.0) < 1e-9


def test_slow_but_progressing_is_not_stalled():
    # one step every 1.5 s, polled every 0.5 s, window 2 s
    tr = tracker()
    for i in range(60):
        t = 100 + i * 0.5
        v = ready_at(tr, t, R(1, 0, hb=(i // 3)))
        assert not v.stalled, f"false stall at t={t}"
        assert v.no_progress_seconds <= 1.5


def test_flat_heartbeat_with_work_stalls_at_stall_after():
    tr = tracker()
    ready_at(tr, 100.0, R(1, 0, hb=10))
    ready_at(tr, 100.5, R(1, 0, hb=20))  # last movement seen at 100.5
    v = ready_at(tr, 102.0, R(1, 0, hb=20))
    assert not v.stalled and v.no_progress_seconds == 1.5
    v = ready_at(tr, 102.5, R(1, 0, hb=20))
    assert v.stalled and v.reason == "heartbeat_flat" and v.no_progress_seconds == 2.0
    assert v.evidence["running"] == 1 and v.evidence["heartbeat"] == 20


def test_poll_jitter_does_not_cost_a_poll():
    tr = tracker(jitter=0.05)
    ready_at(tr, 100.0, R(1, 0, hb=1))
    ready_at(tr, 100.5, R(1, 0, hb=2))
    assert not ready_at(tr, 102.44, R(1, 0, hb=2)).stalled  # earlier than the jitter allows
    v = ready_at(tr, 102.499, R(1, 0, hb=2))  # the 2.0 s tick, landed 1 ms early
    assert v.stalled and v.reason == "heartbeat_flat"


def test_waiting_only_with_flat_heartbeat_stalls():
    tr = tracker()
    ready_at(tr, 100.0, R(0, 0, hb=10))
    ready_at(tr, 101.0, R(0, 3, hb=10))  # work arrived; idle until 100.0 (last seen idle)
    v = ready_at(tr, 102.0, R(0, 3, hb=10))
    assert v.stalled and v.reason == "heartbeat_flat"


def test_completion_counter_moving_is_not_progress():
    """llama-server: tokens_predicted_total jumps when a slot is released; the heartbeat
    (n_decode_total) is what counts."""
    tr = tracker()
    ready_at(tr, 100.0, R(2, 0, hb=50, tokens=0))
    ready_at(tr, 101.0, R(2, 0, hb=50, tokens=260))
    v = ready_at(tr, 102.0, R(2, 0, hb=50, tokens=520))
    assert v.stalled and v.reason == "heartbeat_flat"


def test_frozen_process_no_answers_counts_as_flat():
    """SIGSTOP: /health and /metrics both time out; the last reading had work pending."""
    tr = tracker(unhealthy_after=30)
    ready_at(tr, 100.0, R(1, 0, hb=10))
    ready_at(tr, 100.5, R(1, 0, hb=11))
    v = tr.observe(Observation(102.0, 10, 0.0, "timeout", None, "timeout", None))
    assert not v.stalled
    v = tr.observe(Observation(102.5, 10, 0.0, "timeout", None, "timeout", None))
    assert v.stalled and v.reason == "heartbeat_flat"
    assert v.evidence["health"] == "timeout" and v.evidence["metrics_error"] == "timeout"


def test_metrics_unanswered_while_health_ready():
    tr = tracker()
    ready_at(tr, 100.0, R(0, 0, hb=10))  # idle: the heartbeat rule cannot fire
    for t in (100.5, 101.0, 102.0):
        v = tr.observe(Observation(t, 10, 0.0, "ready", None, "timeout"))
        assert not v.stalled
    v = tr.observe(Observation(102.5, 10, 0.0, "ready", None, "timeout"))
    assert v.stalled and v.reason == "metrics_unanswered"


def test_cpu_pinned_with_flat_heartbeat_even_when_gauges_say_idle():
    # vllm#37729: wedged with num_requests_running = 0; the EngineCore spins.
    tr = tracker()
    cpu = 50.0
    v = None
    for i in range(8):
        t = 100 + i * 0.5
        v = ready_at(tr, t, R(0, 0, hb=10), cpu=cpu)
        cpu += 0.5  # 100 % of one core
        if t - 100 < 2.0:  # pinned from the first sample (t=100) on
            assert not v.stalled
    assert v.stalled and v.reason == "cpu_spin" and v.cpu_percent == 100.0


def test_cpu_busy_but_progressing_is_fine():
    tr = tracker()
    cpu = 0.0
    for i in range(20):
        v = ready_at(tr, 100 + i * 0.5, R(1, 0, hb=i), cpu=cpu)
        cpu += 0.5
        assert not v.stalled


def test_health_failing_for_unhealthy_after():
    tr = tracker(unhealthy_after=3.0)
    ready_at(tr, 100.0, R(0, 0, hb=1))
    v = tr.observe(Observation(101.0, 10, 0.0, "failed", R(0, 0, hb=1)))
    assert v.state == "idle"
    v = tr.observe(Observation(104.0, 10, 0.0, "failed", R(0, 0, hb=1)))
    assert v.state == "unhealthy" and v.reason == "health_failing" and not v.stalled


def test_slow_health_while_progressing_is_not_unhealthy():
    """SGLang's /health queues a 1-token generation behind the batch: a timeout there while
    the heartbeat moves is not an unhealthy engine."""
    tr = tracker(unhealthy_after=3.0)
    ready_at(tr, 100.0, R(2, 0, hb=1))
    for i in range(1, 10):
        v = tr.observe(Observation(100.0 + i, 10, 0.0, "timeout", R(2, 0, hb=1 + i)))
        assert v.state == "busy" and v.reason is None
    for i in range(10, 14):  # progress stops too: now it is a stall (window 2 s)
        v = tr.observe(Observation(100.0 + i, 10, 0.0, "timeout", R(2, 0, hb=10)))
    assert v.stalled and v.reason == "heartbeat_flat"


def test_step_multiple_window_with_floor_and_cap():
    tr = StallTracker(StallSettings(stall_after=60.0, step_multiple=4.0, floor=3.0))
    for i in range(10):  # one step per 0.5 s poll -> step 0.5 s -> 4 x 0.5 = 2 < floor 3
        ready_at(tr, 100 + i * 0.5, R(1, 0, hb=i))
    assert tr.window() == 3.0
    v = ready_at(tr, 107.5, R(1, 0, hb=9))
    assert v.stalled and v.stall_window == 3.0


def test_starting_no_stall_and_time_to_ready_from_pid_start():
    tr = tracker()
    # first sight: new process, not ready; started at 90
    v = tr.observe(Observation(100.0, 20, 90.0, "refused", None, "refused"))
    assert v.state == "starting"
    for t in (101, 105, 130):  # far longer than stall_after: no stall while starting
        v = tr.observe(Observation(float(t), 20, 90.0, "timeout", None, "timeout"))
        assert v.state == "starting" and not v.stalled
    v = tr.observe(Observation(131.0, 20, 90.0, "ready", R(0, 0, hb=0)))
    assert v.became_ready and v.time_to_ready == 41.0 and v.state == "idle"


def test_old_process_health_does_not_count_after_restart():
    """INCIDENTS §8: polling health while the old process was still exiting gave a false
    'ready in 20 s'. Only the new PID's health counts."""
    tr = tracker()
    ready_at(tr, 100.0, R(1, 0, hb=1), pid=30)
    tr.mark_starting()
    v = tr.observe(Observation(101.0, 30, 0.0, "ready", R(1, 0, hb=1)))  # old PID still answering
    assert v.state == "starting" and not v.became_ready
    v = tr.observe(Observation(102.0, None))
    assert v.state == "down"
    v = tr.observe(Observation(103.0, 31, 102.5, "refused", None, "refused"))
    assert v.state == "starting" and v.new_pid
    v = tr.observe(Observation(110.0, 31, 102.5, "ready", R(0, 0, hb=0)))
    assert v.became_ready and v.time_to_ready == 7.5


def test_new_pid_is_reported_once():
    tr = tracker()
    assert not ready_at(tr, 100.0, R(), pid=1).new_pid  # present at gpuguard start: not witnessed
    assert ready_at(tr, 101.0, R(), pid=2).new_pid
    assert not ready_at(tr, 102.0, R(), pid=2).new_pid


def test_decode_gap_when_prefill_starves_decode():
    """INCIDENTS §9: heartbeat moving (prefill chunks) while decode tokens do not."""
    tr = StallTracker(StallSettings(stall_after=60.0), separates_decode=True)
    ready_at(tr, 100.0, R(2, 0, hb=10, decode=100, prefill=1000))
    ready_at(tr, 101.0, R(2, 0, hb=11, decode=110, prefill=1000))
    v = None
    for i in range(1, 6):
        v = ready_at(tr, 101.0 + i, R(2, 0, hb=11 + i, decode=110, prefill=1000 + 2048 * i))
    assert not v.stalled
    assert v.decode_gap_seconds == 5.0 and v.no_progress_seconds == 0.0


# -- issue 13: progress of any kind, the prefill batch bound, unresponsive, honest rates ----

def obs(t, reading, *, health="ready", cpu=None, state="R", batch=4096, pid=10):
    return Observation(t, pid, 0.0, health, reading, None if reading is not None else "timeout", cpu,
                       process_state=state, batch_tokens=batch)


def warm_llama(tr, t0=100.0):
    """Two scrapes that show a prefill rate of 400 tokens/s by the engine's own clock."""
    tr.observe(obs(t0, R(1, 0, hb=10, prefill=0, prefill_seconds=0.0), cpu=1.0))
    v = tr.observe(obs(t0 + 1, R(1, 0, hb=20, prefill=800, prefill_seconds=2.0), cpu=2.0))
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] == 400.0
    return t0 + 1


def test_prompt_tokens_moving_is_progress():
    tr = tracker()
    ready_at(tr, 100.0, R(1, 1, hb=5, prefill=0))
    for i in range(1, 10):
        v = ready_at(tr, 100.0 + i, R(1, 1, hb=5, prefill=1000 * i))
        assert not v.stalled and v.no_progress_seconds == 0.0


def test_long_prompt_batch_is_allowed_its_time_at_the_measured_rate():
    """llama-server runs one n_batch (4096) prompt batch in one llama_decode: nothing moves
    and /metrics answers nothing; at 400 tokens/s x margin 2 that may take 20.48 s."""
    tr = tracker(stall_after=8.0)
    t = warm_llama(tr)
    for i in range(1, 21):  # 20 s of silence, the process on CPU
        v = tr.observe(obs(t + i, None, cpu=2.0 + i))
        assert not v.stalled, (i, v.reason, dict(v.evidence))
        assert v.state == "busy" and v.tokens_per_second is None
    assert v.evidence["prefill_batch"]["applies"] and v.evidence["prefill_batch"]["bound_seconds"] == 20.48
    v = tr.observe(obs(t + 21, None, cpu=23.0))
    assert v.stalled and v.reason == "heartbeat_flat" and v.stall_window == 20.48
    assert "nothing from outside separates" in v.evidence["prefill_batch"]["note"]


def test_batch_ceiling_caps_the_bound():
    tr = tracker(stall_after=8.0, prefill_ceiling=12.0)
    t = warm_llama(tr)
    assert not tr.observe(obs(t + 11, None, cpu=5.0)).stalled
    assert tr.observe(obs(t + 12, None, cpu=6.0)).stalled


def test_stopped_process_gets_no_batch_stretch():
    tr = tracker(stall_after=8.0)
    t = warm_llama(tr)
    v = tr.observe(obs(t + 4, None, health="timeout", cpu=2.0, state="T"))
    assert v.state == "unresponsive" and v.tokens_per_second is None and not v.stalled
    v = tr.observe(obs(t + 8, None, health="timeout", cpu=2.0, state="T"))
    assert v.stalled and v.stall_window == 8.0
    assert v.evidence["prefill_batch"]["why_not"].startswith("process state T")


def test_process_using_no_cpu_gets_no_batch_stretch():
    tr = tracker(stall_after=8.0)
    t = warm_llama(tr)
    tr.observe(obs(t + 4, None, cpu=2.5, state="S"))
    v = tr.observe(obs(t + 8, None, cpu=2.5, state="S"))
    assert v.stalled and "no CPU" in v.evidence["prefill_batch"]["why_not"]


def test_no_measured_prefill_rate_means_stall_after():
    tr = tracker(stall_after=8.0)
    ready_at(tr, 100.0, R(1, 0, hb=10), cpu=1.0)
    v = tr.observe(obs(108.0, None, cpu=9.0))
    assert v.stalled and v.evidence["prefill_batch"]["why_not"] == "no prefill rate measured yet"


def test_unresponsive_shows_no_rate_and_does_not_repeat_the_last():
    tr = tracker(stall_after=60.0)
    ready_at(tr, 100.0, R(1, 0, hb=0))
    v = ready_at(tr, 101.0, R(1, 0, hb=40))
    assert v.tokens_per_second == 40.0 and v.state == "busy"
    v = tr.observe(obs(102.0, None, health="timeout"))
    assert v.state == "unresponsive" and v.tokens_per_second is None
    # answering again: the rate is over the real 2 s since the last answer
    v = ready_at(tr, 103.0, R(1, 0, hb=120))
    assert v.state == "busy" and v.tokens_per_second == 40.0


def test_decode_gap_is_the_longest_recent_gap_not_the_current_one():
    tr = StallTracker(StallSettings(stall_after=60.0), separates_decode=True)
    ready_at(tr, 100.0, R(2, 0, hb=10, decode=100, prefill=0))
    for i in range(1, 8):  # decode starved 7 s while prefill chunks run
        v = ready_at(tr, 100.0 + i, R(2, 0, hb=10 + i, decode=100, prefill=2048 * i))
    assert v.decode_gap_seconds == 7.0
    for i in range(8, 12):  # decoding again every poll
        v = ready_at(tr, 100.0 + i, R(2, 0, hb=10 + i, decode=100 + i, prefill=2048 * 7))
    # the longest, still in the window: from 100, the last poll that saw decode move, to 108,
    # the first that saw it move again
    assert not v.stalled and v.decode_gap_seconds == 8.0
    v = ready_at(tr, 100.0 + 8 + 301, R(2, 0, hb=500, decode=900, prefill=2048 * 7))
    assert v.decode_gap_seconds == 0.0  # out of the 300 s window


def test_scrape_measured_prefill_rate_needs_a_real_batch():
    """vLLM/SGLang export no prompt seconds: the rate comes from wall time between scrapes,
    which a few 16-token prompts would make absurdly low (and a hang wait minutes)."""
    tr = tracker(stall_after=8.0)
    tr.observe(obs(100.0, R(2, 0, hb=10, prefill=0), cpu=1.0, batch=8192))
    v = tr.observe(obs(101.0, R(2, 0, hb=20, prefill=32), cpu=2.0, batch=8192))
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] is None
    v = tr.observe(obs(109.0, None, cpu=10.0, batch=8192))
    assert v.stalled  # at stall_after, no stretch
    tr = tracker(stall_after=8.0)
    tr.observe(obs(100.0, R(2, 0, hb=10, prefill=0), cpu=1.0, batch=8192))
    v = tr.observe(obs(101.0, R(2, 0, hb=20, prefill=8192), cpu=2.0, batch=8192))
    assert v.evidence["prefill_batch"]["prefill_rate_tokens_per_second"] == 8192.0
    assert v.evidence["prefill_batch"]["rate_from"] == "scrapes"


def test_step_multiple_window_is_capped_at_stall_after():
    """k x step time may not stretch the window past stall_after: a slow-stepping engine
    that stops is still a stall at stall_after, not at 4 x its step."""
    tr = StallTracker(StallSettings(stall_after=6.0, step_multiple=4.0, floor=3.0))
    for i in range(6):  # one step every 2 s -> 4 x 2 = 8 s, above stall_after
        ready_at(tr, 100 + i * 2.0, R(1, 0, hb=i))
    assert tr.window() == 6.0
    v = ready_at(tr, 110.0 + 5.9, R(1, 0, hb=5))
    assert not v.stalled
    v = ready_at(tr, 110.0 + 6.0, R(1, 0, hb=5))
    assert v.stalled and v.stall_window == 6.0

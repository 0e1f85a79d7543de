"""Stall detection for one engine: a pure state machine fed one `Observation` per poll with
explicit timestamps (no clock, no I/O), so every rule is testable to the second.

Rules (ENGINES.md "How to detect a stall from outside", INCIDENTS §1, §8, §9):
- heartbeat_flat: work pending (running or waiting > 0) and the per-step heartbeat counter
  flat for the stall window (`stall_after`, or k x recent step time with a floor, capped
  at `stall_after`). While /metrics does not answer, the last known reading stands and the
  heartbeat counts as flat: a frozen process answers nothing.
- metrics_unanswered: /health answers ready while /metrics does not, for the window
  (llama-server's wedged main loop).
- cpu_spin: the GPU-owning process pinned on CPU and the heartbeat flat for the window,
  whatever the gauges say (a wedged vLLM was seen reporting running = 0).
- health_failing: health not ready for `unhealthy_after` with no heartbeat movement
  meanwhile (state `unhealthy`).
- While starting (a new PID whose health is not ready yet) all of that is off; time to
  ready is measured from the new PID's start time (§8).
- Time the watchdog did not observe (`unobserved`: its own pause, a host suspend;
  engines/lapses.py) is no engine's lack of progress: every clock above restarts at the
  first observation after it.

Progress is any of: the step counter, live generated tokens, prompt tokens (§9: a
long prefill starving decode is work, never a stall). One step may carry a whole prompt
batch during which nothing moves and llama-server answers no /metrics at all: while the
GPU process can be working (not stopped, its CPU time moving) and a prefill rate has been
measured, every bound above stretches to margin x batch tokens / prefill rate (capped by
the ceiling). A stopped process, or one using no CPU, gets no stretch. Nothing seen from
outside separates such a batch from a spinning hang before that bound; the evidence says so.

`unresponsive`: neither /health nor /metrics answered this poll; the rate is then absent,
never the last good value. `decode_gap_seconds`: the longest time without decode progress
while requests ran, over the last DECODE_GAP_WINDOW seconds, from the last poll that saw the
decode counter move (or had no decode work) to the first poll that saw it move again: the
last token before the gap came after the poll before that one, the first after it before the
closing poll, so the true gap lies within one poll interval of the figure (the gauge's
resolution). While a gap is open the figure is the time since that last poll."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from gpuguard.engines.adapters import EngineReading

STATES = ("starting", "ready", "idle", "busy", "unresponsive", "stalled", "unhealthy", "down")
EWMA_ALPHA = 0.3
DECODE_GAP_WINDOW = 300.0
NOT_ANSWERING = ("timeout", "refused", "error")
STOPPED_STATES = ("T", "t", "Z", "X")
BATCH_NOTE = ("a prompt batch runs inside one engine step and nothing from outside separates it from a hang "
              "until the batch bound has passed")


@dataclass(frozen=True)
class StallSettings:
    stall_after: float = 60.0
    step_multiple: float | None = None
    floor: float = 5.0
    cpu_busy_ratio: float = 0.9
    unhealthy_after: float = 30.0
    ready_timeout: float = 900.0
    # Polls land a few ms either side of their tick; without this a window that is a
    # multiple of the poll interval would wait one extra poll about half the time.
    jitter: float = 0.0
    prefill_margin: float = 2.0
    prefill_ceiling: float = 300.0

    @classmethod
    def from_config(cls, cfg: Any) -> "StallSettings":
        return cls(cfg.stall_after, cfg.stall_step_multiple, cfg.stall_floor, cfg.cpu_busy_ratio,
                   cfg.unhealthy_after, cfg.ready_timeout, jitter=0.1 * cfg.poll_interval,
                   prefill_margin=cfg.prefill_margin, prefill_ceiling=cfg.prefill_ceiling)


@dataclass(frozen=True)
class Observation:
    time: float
    pid: int | None
    pid_start: float | None = None
    health: str | None = None  # ready starting failed timeout refused error; None = not probed
    reading: EngineReading | None = None
    metrics_error: str | None = None
    cpu_seconds: float | None = None  # GPU-owning process, utime+stime
    process_state: str | None = None  # GPU-owning process, /proc/PID/stat state letter
    batch_tokens: int | None = None  # largest prompt batch one step may carry
    unobserved: float = 0.0  # seconds just before this observation that nobody watched


@dataclass(frozen=True)
class Verdict:
    state: str
    stalled: bool
    reason: str | None
    no_progress_seconds: float
    decode_gap_seconds: float | None
    tokens_per_second: float | None
    cpu_percent: float | None
    step_seconds: float | None
    stall_window: float
    time_to_ready: float | None
    new_pid: bool
    became_ready: bool
    reading: EngineReading | None  # last known
    evidence: Mapping[str, Any] = field(default_factory=dict)


class StallTracker:
    def __init__(self, settings: StallSettings, *, separates_decode: bool = False) -> None:
        self.s = settings
        self.separates_decode = separates_decode  # the engine has a decode-progress counter
        self._seen_any = False
        self._pid: int | None = None
        self._reset_process(None, None)

    # -- lifecycle ---------------------------------------------------------------------
    def _reset_process(self, pid: int | None, pid_start: float | None) -> None:
        self._pid = pid
        self._pid_start = pid_start
        self._phase = "starting"
        self._witnessed_start = False
        self._stale_pid: int | None = None
        self._time_to_ready: float | None = None
        self._last: EngineReading | None = None
        self._last_t: float | None = None
        self._hb: float | None = None
        self._hb_changed: float | None = None
        self._idle_at: float | None = None
        self._dec: float | None = None
        self._dec_changed: float | None = None
        self._no_decode_work_at: float | None = None
        self._step: float | None = None
        self._cpu_prev: tuple[float, float] | None = None
        self._cpu_pct: float | None = None
        self._cpu_pinned_since: float | None = None
        self._health_bad_since: float | None = None
        self._metrics_bad_since: float | None = None
        self._rate: float | None = None
        self._running_since: float | None = None
        self._progress_at: float | None = None
        self._prefill_rate: float | None = None
        self._prefill_rate_from = ""
        self._gaps: list[tuple[float, float]] = []  # (closed at, seconds seen flat)
        self._gap_now = 0.0
        self._gap_from: float | None = None  # the last poll that saw decode progress, while a gap is open
        self._cpu_moved: bool | None = None
        self._start_unobserved = 0.0  # unobserved seconds since the PID started, while starting

    def _restart_clocks(self, t: float) -> None:
        """After time nobody watched: every 'flat since' / 'bad since' starts again at t
        (what happened meanwhile is unknown, so it counts neither way)."""
        for name in ("_progress_at", "_idle_at", "_running_since", "_health_bad_since", "_metrics_bad_since",
                     "_dec_changed", "_no_decode_work_at"):
            if getattr(self, name) is not None:
                setattr(self, name, t)
        self._gap_now = 0.0
        self._cpu_prev = None  # CPU use is measured afresh from here
        self._cpu_pinned_since = None

    def mark_starting(self) -> None:
        """After gpuguard restarted the engine: until a NEW PID says ready, it is starting.
        Health answered by the old, still-exiting process does not count (INCIDENTS §8)."""
        old = self._pid
        self._reset_process(old, self._pid_start)
        self._stale_pid = old

    # -- one poll ----------------------------------------------------------------------
    def observe(self, o: Observation) -> Verdict:
        first = not self._seen_any
        self._seen_any = True
        if o.pid is None:
            self._reset_process(None, None)
            return self._verdict(o, "down", None, new_pid=False)

        new_pid = False
        if o.pid != self._pid:
            new_pid = not first and True
            stale = self._stale_pid
            self._reset_process(o.pid, o.pid_start)
            self._witnessed_start = new_pid or (o.health != "ready")
            if stale is not None and stale != o.pid:
                new_pid = True
        if o.unobserved and self._phase == "starting":
            lived = o.time - self._pid_start if self._pid_start is not None else o.unobserved
            self._start_unobserved += max(0.0, min(o.unobserved, lived))
        elif o.unobserved and not new_pid:
            self._restart_clocks(o.time)
        if self._phase == "starting":
            if self._stale_pid is not None and o.pid == self._stale_pid:
                return self._verdict(o, "starting", None, new_pid=new_pid)
            if o.health == "ready":
                self._phase = "running"
                self._running_since = o.time
                self._idle_at = o.time
                if self._witnessed_start and self._pid_start is not None:
                    self._time_to_ready = max(0.0, o.time - self._pid_start)
                v = self._running(o, new_pid, became_ready=True)
                return v
            self._witnessed_start = True
            if (self._pid_start is not None
                    and o.time - self._pid_start - self._start_unobserved >= self.s.ready_timeout):
                return self._verdict(o, "unhealthy", "ready_timeout", new_pid=new_pid)
            return self._verdict(o, "starting", None, new_pid=new_pid)
        return self._running(o, new_pid, became_ready=False)

    def _running(self, o: Observation, new_pid: bool, became_ready: bool) -> Verdict:
        t = o.time
        # health
        if o.health == "ready":
            self._health_bad_since = None
        elif self._health_bad_since is None:
            self._health_bad_since = t
        # metrics
        r = o.reading
        if r is None:
            if self._metrics_bad_since is None:
                self._metrics_bad_since = t
        else:
            self._metrics_bad_since = None
            self._take_reading(r, t, o.batch_tokens)
        last = self._last
        pending = bool(last.pending) if last is not None else False
        if not pending:
            self._idle_at = t
        anchor = max(x for x in (self._progress_at, self._idle_at, self._running_since) if x is not None)
        no_progress = t - anchor if pending else 0.0
        # decode gap (§9): the decode counter flat while requests run; the longest recently
        decode_gap = None
        if self.separates_decode and last is not None and last.decode is not None:
            if not last.running:
                self._no_decode_work_at = t
            if last.running:
                a = max(x for x in (self._dec_changed, self._no_decode_work_at, self._running_since) if x is not None)
                self._gap_now, self._gap_from = t - a, a
            else:
                self._gap_now, self._gap_from = 0.0, None
            self._gaps = [(at, g) for at, g in self._gaps if at >= t - DECODE_GAP_WINDOW]
            decode_gap = max([self._gap_now] + [g for _, g in self._gaps])
        # CPU of the GPU-owning process
        self._cpu_moved = None
        if o.cpu_seconds is not None:
            if self._cpu_prev is not None and t > self._cpu_prev[0]:
                self._cpu_moved = o.cpu_seconds > self._cpu_prev[1]
                self._cpu_pct = max(0.0, (o.cpu_seconds - self._cpu_prev[1]) / (t - self._cpu_prev[0]) * 100.0)
                if self._cpu_pct >= self.s.cpu_busy_ratio * 100.0:
                    if self._cpu_pinned_since is None:
                        self._cpu_pinned_since = self._cpu_prev[0]
                else:
                    self._cpu_pinned_since = None
            self._cpu_prev = (t, o.cpu_seconds)
        window = self.window()
        hb_flat_for = t - max(x for x in (self._progress_at, self._running_since) if x is not None)
        batch = self._batch_bound(o)
        bound = max(window, batch["bound_seconds"]) if batch["applies"] else window

        due = bound - self.s.jitter
        reason = None
        if pending and last is not None and last.heartbeat is not None and no_progress >= due:
            reason = "heartbeat_flat"
        elif o.health == "ready" and self._metrics_bad_since is not None and t - self._metrics_bad_since >= due:
            reason = "metrics_unanswered"
        elif (self._cpu_pinned_since is not None and t - self._cpu_pinned_since >= due
              and hb_flat_for >= due):
            reason = "cpu_spin"
        elif (self._health_bad_since is not None and t - self._health_bad_since >= self.s.unhealthy_after
              and (self._progress_at is None or self._progress_at <= self._health_bad_since)):
            # Progress proves the engine alive: SGLang's /health is a 1-token generation that
            # can queue behind a large batch; only failing health with no step counts.
            reason = "health_failing"

        unanswered = o.health in NOT_ANSWERING and r is None
        if reason == "health_failing":
            state = "unhealthy"
        elif reason:
            state = "stalled"
        elif unanswered:
            state = "unresponsive"
        elif last is None:
            state = "ready"
        else:
            state = "busy" if pending else "idle"
        return self._verdict(o, state, reason, new_pid=new_pid, became_ready=became_ready,
                             no_progress=no_progress, decode_gap=decode_gap, window=bound,
                             fresh=r is not None,
                             extra={"heartbeat_flat_seconds": round(hb_flat_for, 3),
                                    "progress_flat_seconds": round(hb_flat_for, 3),
                                    "step_window_seconds": window,
                                    "prefill_batch": batch,
                                    "process_state": o.process_state,
                                    "cpu_pinned_seconds": (round(t - self._cpu_pinned_since, 3)
                                                           if self._cpu_pinned_since is not None else None),
                                    "metrics_unanswered_seconds": (round(t - self._metrics_bad_since, 3)
                                                                   if self._metrics_bad_since is not None else None),
                                    "health_failing_seconds": (round(t - self._health_bad_since, 3)
                                                               if self._health_bad_since is not None else None)})

    def _take_reading(self, r: EngineReading, t: float, batch_tokens: int | None = None) -> None:
        prev, prev_t = self._last, self._last_t
        if prev is not None and any(
                getattr(r, k) is not None and getattr(prev, k) is not None and getattr(r, k) != getattr(prev, k)
                for k in ("heartbeat", "live_tokens", "prefill")):
            self._progress_at = t
        if (prev is not None and prev_t is not None and r.prefill is not None and prev.prefill is not None
                and r.prefill > prev.prefill):
            self._learn_prefill_rate(prev, r, t - prev_t, batch_tokens)
        if r.heartbeat is not None:
            if self._hb is None or r.heartbeat != self._hb:
                if (self._hb is not None and prev_t is not None and r.heartbeat > self._hb
                        and prev is not None and prev.pending):
                    step = (t - prev_t) / (r.heartbeat - self._hb)
                    self._step = step if self._step is None else (1 - EWMA_ALPHA) * self._step + EWMA_ALPHA * step
                if self._hb is not None:
                    self._hb_changed = t
                self._hb = r.heartbeat
        if r.decode is not None:
            if self._dec is not None and r.decode != self._dec:
                if self._gap_now > 0 and self._gap_from is not None:
                    # closed at this poll, the first to see decode resume (not at the last
                    # flat one: that read every gap one poll short)
                    self._gaps.append((t, t - self._gap_from))
                self._dec_changed = t
            self._dec = r.decode
        # Tokens over the real time between two answered scrapes (a missed poll widens the
        # interval, it never repeats a rate).
        cur = r.live_tokens
        before = prev.live_tokens if prev is not None else None
        if cur is not None and before is not None and prev_t is not None and t > prev_t and cur >= before:
            self._rate = (cur - before) / (t - prev_t)
        else:
            self._rate = None
        self._last, self._last_t = r, t

    def _learn_prefill_rate(self, prev: EngineReading, r: EngineReading, dt: float,
                            batch_tokens: int | None) -> None:
        tokens = r.prefill - prev.prefill  # type: ignore[operator]
        if r.prefill_seconds is not None and prev.prefill_seconds is not None and r.prefill_seconds > prev.prefill_seconds:
            # The engine's own cumulative ratio: token-weighted, so a few tiny prompts (whose
            # per-token time is all overhead) cannot talk the bound down.
            self._prefill_rate = r.prefill / r.prefill_seconds  # type: ignore[operator]
            self._prefill_rate_from = "engine"
        elif self._prefill_rate_from != "engine" and dt > 0 and batch_tokens and tokens >= batch_tokens / 4:
            # Wall time between scrapes under-estimates the rate (the interval was not all
            # prefill): only an interval with at least a quarter batch of prompt tokens tells
            # anything (a few short prompts would make a hang wait minutes), and the best
            # seen is the closest to the engine's real speed.
            rate = tokens / dt
            self._prefill_rate = max(self._prefill_rate or 0.0, rate)
            self._prefill_rate_from = "scrapes"

    def _batch_bound(self, o: Observation) -> dict[str, Any]:
        """The time one prompt batch may take, and whether it applies now."""
        rate, size = self._prefill_rate, o.batch_tokens
        out: dict[str, Any] = {"tokens": size, "prefill_rate_tokens_per_second":
                               None if rate is None else round(rate, 1), "rate_from": self._prefill_rate_from or None,
                               "bound_seconds": 0.0, "applies": False}
        if not rate or not size:
            out["why_not"] = "no prefill rate measured yet" if not rate else "batch size unknown"
            return out
        out["bound_seconds"] = round(min(self.s.prefill_ceiling, self.s.prefill_margin * size / rate), 3)
        if o.process_state in STOPPED_STATES:
            out["why_not"] = f"process state {o.process_state}: it cannot be working"
        elif self._cpu_moved is False:
            out["why_not"] = "the GPU process used no CPU since the last poll"
        else:
            out["applies"] = True
            out["note"] = BATCH_NOTE
        return out

    def window(self) -> float:
        s = self.s
        if s.step_multiple and self._step:
            return min(s.stall_after, max(s.floor, s.step_multiple * self._step))
        return s.stall_after

    def _verdict(self, o: Observation, state: str, reason: str | None, *, new_pid: bool,
                 became_ready: bool = False, no_progress: float = 0.0, decode_gap: float | None = None,
                 window: float | None = None, extra: dict | None = None, fresh: bool = False) -> Verdict:
        last = self._last
        ev: dict[str, Any] = {
            "health": o.health,
            "metrics_error": o.metrics_error,
            "running": last.running if last else None,
            "waiting": last.waiting if last else None,
            "heartbeat": last.heartbeat if last else None,
            "tokens": last.tokens if last else None,
            "no_progress_seconds": round(no_progress, 3),
            "stall_window_seconds": window if window is not None else self.window(),
            "step_seconds": self._step,
            "cpu_percent": None if self._cpu_pct is None else round(self._cpu_pct, 1),
            "cpu_seconds": o.cpu_seconds,
        }
        if extra:
            ev.update(extra)
        if o.unobserved:
            ev["unobserved_seconds"] = round(o.unobserved, 3)
        return Verdict(
            state=state, stalled=state == "stalled", reason=reason,
            no_progress_seconds=no_progress, decode_gap_seconds=decode_gap,
            tokens_per_second=self._rate if fresh and state not in ("down", "starting", "unresponsive") else None,
            cpu_percent=self._cpu_pct, step_seconds=self._step,
            stall_window=window if window is not None else self.window(),
            time_to_ready=self._time_to_ready, new_pid=new_pid, became_ready=became_ready,
            reading=last, evidence=MappingProxyType(ev))

"""The engine watchdog: one async loop per configured engine (so a hung engine delays only
itself), each poll resolving the PID afresh, probing /health and /metrics with short
timeouts, feeding the stall state machine, publishing an immutable `EngineSnapshot`, and
acting by policy (alert / kill / restart), every action audited and raised as an Event.
Also the hooks the kernel-event code calls when an engine's GPU hangs or resets."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

from gpuguard.engines.actions import CommandResult, KillResult, kill_engine, restart_argv, run_command
from gpuguard.engines.adapters import Adapter
from gpuguard.engines.attribution import GpuAttribution, GpuProcess
from gpuguard.engines.caches import CacheError, CacheScan, quarantine_set, scan_zero_byte
from gpuguard.engines.config import EngineConfig
from gpuguard.engines.exposure import Exposure, ExposureWatch
from gpuguard.engines.incidents import IncidentStore
from gpuguard.engines.lapses import Lapses
from gpuguard.engines.probe import EngineProbe, ProbeResult
from gpuguard.engines.process import EngineProcesses, ProcessLookupFailed, resolve
from gpuguard.engines.restarts import RestartLedger
from gpuguard.engines.snapshot import EngineSnapshot
from gpuguard.engines.stall import Observation, StallSettings, StallTracker, Verdict
from gpuguard.state.audit import EngineAction, Outcome
from gpuguard.state.events import Event

log = logging.getLogger("gpuguard.engines")
SOURCE = "engines"
RESOLVE_TIMEOUT = 5.0


@dataclass
class _Engine:
    cfg: EngineConfig
    adapter: Adapter
    probe: EngineProbe
    tracker: StallTracker
    ledger: RestartLedger
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    snapshot: EngineSnapshot | None = None
    last_action: str | None = None
    episode: str | None = None  # reason of the stall/unhealthy episode already handled
    polls: int = 0
    last_cache_scan: float | None = None
    procs: EngineProcesses | None = None
    # a restart gpuguard made and has not yet seen come back: (when, reason, old main PID)
    restart_pending: tuple[float, str, int | None] | None = None
    gpu_holders: tuple[GpuProcess, ...] = ()  # its processes' holds on GPUs, last scan
    held_by: dict[int, GpuProcess] = field(default_factory=dict)  # pid -> hold, seen while it ran
    vram_alerted: bool = False
    unobserved_seen: float | None = None  # Lapses.total at its previous observation
    # the graded response and its evidence
    episode_at: float | None = None  # when the current stall/unhealthy episode was declared
    dumped: bool = False
    acted: bool = False
    last_incident: str | None = None
    samples: deque = field(default_factory=lambda: deque(maxlen=600))  # recent readings
    raw: deque = field(default_factory=lambda: deque(maxlen=5))  # recent raw /metrics texts
    pause: dict | None = None  # the no-progress period in progress
    pauses: deque = field(default_factory=lambda: deque(maxlen=1000))  # pauses that ended by themselves
    pause_buckets: list = field(default_factory=lambda: [0] * len(PAUSE_BUCKETS))
    pause_sum: float = 0.0
    pause_count: int = 0
    exposure: ExposureWatch = field(default_factory=ExposureWatch)  # INCIDENTS §10

    @property
    def gpus(self) -> tuple[str, ...]:
        """Configured GPUs, else the ones its processes hold."""
        if self.cfg.gpus:
            return tuple(self.cfg.gpus)
        return tuple(sorted({g.bdf for g in self.gpu_holders}))


CLOSE_TIMEOUT = 5.0  # seconds for the engine loops and HTTP clients to stop
ATTRIBUTION_INTERVAL = 2.0  # seconds between scans of which processes hold which GPU
SAMPLE_WINDOW = 300.0  # seconds of engine readings an incident bundle carries
PAUSE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)


class EngineWatchdog:
    def __init__(self, configs: Sequence[EngineConfig], audit: Callable[[EngineAction], None],
                 publish: Callable[[Event], None], *, clock: Callable[[], float] = time.time,
                 attribution: GpuAttribution | None = None, incidents: IncidentStore | None = None,
                 gpu_telemetry: Callable[[Sequence[str]], dict[str, dict]] | None = None,
                 lapses: Lapses | None = None) -> None:
        self.attribution = attribution
        self.lapses = lapses or Lapses()  # time this watchdog did not run: never an engine's stall
        self.incidents = incidents
        self.gpu_telemetry = gpu_telemetry  # GPU name -> {"busy_ratio", "power_watts"}, now
        self._gpu_procs: list[GpuProcess] = []
        self.gpu_processes_at: float | None = None  # when the last attribution scan finished
        self._audit_sink = audit
        self._publish_sink = publish
        self._clock = clock
        self._stopping = False
        self._engines: dict[str, _Engine] = {}
        self._actions: Counter[tuple[str, str, str]] = Counter()
        # Stall episodes, counted: the stalled gauge is 1 only until a kill ends the
        # episode (~50 ms), shorter than any scrape interval.
        self._stalls: Counter[tuple[str, str]] = Counter()
        self._cache_scans: dict[str, CacheScan] = {}
        self._cache_owner: dict[str, str] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._running = False
        self._check(configs)
        for cfg in configs:
            self._engines[cfg.name] = self._new_engine(cfg)
            for cache in cfg.caches:
                self._cache_owner[cache.name] = cfg.name

    @staticmethod
    def _check(configs: Sequence[EngineConfig]) -> None:
        names: set[str] = set()
        owner: dict[str, str] = {}
        for cfg in configs:
            if cfg.name in names:
                raise ValueError(f"engines: duplicate name {cfg.name!r}")
            names.add(cfg.name)
            for cache in cfg.caches:
                if cache.name in owner:
                    raise ValueError(f"engines.{cfg.name}.caches: name {cache.name!r} already used by "
                                     f"engine {owner[cache.name]!r}; cache names are metric labels")
                owner[cache.name] = cfg.name

    @staticmethod
    def _new_engine(cfg: EngineConfig) -> _Engine:
        adapter = Adapter(cfg)
        return _Engine(cfg=cfg, adapter=adapter, probe=EngineProbe(adapter),
                       tracker=StallTracker(StallSettings.from_config(cfg), separates_decode=adapter.separates_decode),
                       ledger=RestartLedger(cfg.restart_loop.count, cfg.restart_loop.window))

    def reconfigure(self, configs: Sequence[EngineConfig]) -> dict[str, list[str]]:
        """Apply a reloaded `engines:` list (SIGHUP): new engines start being watched, removed
        ones stop, changed ones take their new settings at their next poll while keeping
        what was learnt (stall state, prefill rate, restart ledger). Sync: called from the
        daemon's signal handler inside the running loop. -> {added, removed, changed}."""
        self._check(configs)
        new = {c.name: c for c in configs}
        out: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        loop = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            pass
        for name in list(self._engines):
            if name not in new:
                e = self._engines.pop(name)
                task = self._tasks.pop(name, None)
                if task is not None:
                    task.cancel()
                if loop is not None:
                    loop.create_task(e.probe.aclose())
                out["removed"].append(name)
        for name, cfg in new.items():
            e = self._engines.get(name)
            if e is None:
                e = self._engines[name] = self._new_engine(cfg)
                if loop is not None and self._running:  # the loops are running: start this one's
                    self._tasks[name] = loop.create_task(self._engine_loop(e), name=f"engine:{name}")
                out["added"].append(name)
            elif cfg != e.cfg:
                old_probe = e.probe
                e.cfg = cfg
                e.adapter = Adapter(cfg)
                e.probe = EngineProbe(e.adapter)
                e.tracker.s = StallSettings.from_config(cfg)
                e.tracker.separates_decode = e.adapter.separates_decode
                e.ledger.count, e.ledger.window = cfg.restart_loop.count, cfg.restart_loop.window
                if loop is not None:
                    loop.create_task(old_probe.aclose())
                out["changed"].append(name)
        self._cache_owner = {c.name: n for n, cfg in new.items() for c in cfg.caches}
        for cache in [c for c in self._cache_scans if c not in self._cache_owner]:
            del self._cache_scans[cache]
        return out

    # -- public read side ----------------------------------------------------------------
    def snapshots(self) -> dict[str, EngineSnapshot]:
        return {name: e.snapshot for name, e in self._engines.items() if e.snapshot is not None}

    def actions_total(self) -> dict[tuple[str, str, str], int]:
        """(engine, action, reason) -> count, for gpuguard_engine_actions_total."""
        return dict(self._actions)

    def stalls_total(self) -> dict[tuple[str, str], int]:
        """(engine, reason) -> stall episodes declared, for gpuguard_engine_stalls_total."""
        return dict(self._stalls)

    def cache_zero_byte_files(self, cache: str) -> int | None:
        """Zero-byte files in the named cache at the last scan; None if never scanned or absent."""
        scan = self._cache_scans.get(cache)
        return scan.zero_byte_files if scan is not None and scan.exists else None

    def cache_scans(self) -> dict[str, CacheScan]:
        return dict(self._cache_scans)

    def gpu_processes(self) -> list[tuple[GpuProcess, str, str]]:
        """(hold, GPU name, engine name or "") for every process holding a GPU, last scan."""
        owner = {pid: name for name, e in self._engines.items() if e.procs for pid in e.procs.pids}
        name = self.attribution.name if self.attribution else (lambda b: b)
        return [(g, name(g.bdf), owner.get(g.pid, "")) for g in self._gpu_procs]

    # -- asked for by name (the control API: control/engine_actions.py) -----------------
    def engine_names(self) -> list[str]:
        return sorted(self._engines)

    def engine_config(self, name: str) -> EngineConfig | None:
        e = self._engines.get(name)
        return e.cfg if e is not None else None

    def cache_owners(self) -> dict[str, tuple[EngineConfig, Any]]:
        """Cache name -> (its engine's config, the cache's config)."""
        return {c.name: (e.cfg, c) for e in self._engines.values() for c in e.cfg.caches}

    async def kill_asked(self, name: str, who: str) -> KillResult | None:
        """The same SIGTERM → grace → SIGKILL → verify-gone as a policy kill, audited with
        `who`; None when the engine has no process to kill. Raises ProcessLookupFailed when
        what was found may not be killed (a pid file someone else wrote, PID 1, ...): the
        caller says why."""
        e = self._engines[name]
        async with e.lock:
            procs = await asyncio.to_thread(resolve, e.cfg)
            if procs is None:
                return None
            evidence = dict(e.snapshot.evidence) if e.snapshot else {}
            return await self._kill(e, procs, "api", evidence, self._clock(), who=who)

    async def restart_asked(self, name: str, who: str) -> dict:
        e = self._engines[name]
        async with e.lock:
            procs = await asyncio.to_thread(_resolve_quiet, e.cfg)
            return await self._restart(e, procs, "api", {}, self._clock(), who=who)

    async def quarantine_asked(self, cache_name: str, who: str) -> dict[str, Any]:
        """Rename the cache aside (never delete: INCIDENTS §7), counted and audited; raises
        CacheError when it cannot be moved."""
        cfg, cache = self.cache_owners()[cache_name]
        e = self._engines[cfg.name]
        scan = await asyncio.to_thread(scan_zero_byte, cache.path)
        target, related = await asyncio.to_thread(quarantine_set, cache.path, cache.related, "api")
        self._actions[(cfg.name, "quarantine", "api")] += 1
        moved = {"from": str(cache.path), "to": str(target), **({"related": related} if related else {})}
        self._audit(e, "quarantine", "api", who,
                    {"cache": cache_name, "zero_byte_files": scan.zero_byte_files, "files": scan.files},
                    moved, self._clock(), "ok", f"renamed {cache.path} -> {target}"
                    + "".join(f", {r['from']} -> {r['to']}" for r in related if "to" in r))
        return {**moved, "zero_byte_files": scan.zero_byte_files}

    # -- GPU attribution -----------------------------------------------------------------
    async def attribute_once(self) -> list[GpuProcess]:
        """Scan which processes hold which GPU; give each engine its holds; alert when an
        engine is gone but a process that held VRAM for it still does (an orphaned worker,
        a process stuck in the driver)."""
        if self.attribution is None:
            return []
        found = await asyncio.to_thread(self.attribution.scan)
        self._gpu_procs = found
        self.gpu_processes_at = self._clock()
        by_pid: dict[int, list[GpuProcess]] = {}
        for g in found:
            by_pid.setdefault(g.pid, []).append(g)
        for e in list(self._engines.values()):
            if e.procs is not None:
                e.gpu_holders = tuple(g for pid in e.procs.pids for g in by_pid.get(pid, ()))
                e.held_by.update({g.pid: g for g in e.gpu_holders})
                e.vram_alerted = False
                continue
            still = [g for pid, old in e.held_by.items() for g in by_pid.get(pid, ()) if g.vram_bytes]
            e.gpu_holders = tuple(still)  # what still holds its GPUs on its behalf
            if still and not e.vram_alerted:
                e.vram_alerted = True
                self._event(e, "engine_vram_held", "alert",
                            f"engine {e.cfg.name} is down but " + ", ".join(
                                f"PID {g.pid} ({g.comm}) still holds {g.vram_bytes / 2**20:.0f} MiB on "
                                f"{self.attribution.name(g.bdf)}" for g in still),
                            holders=[g.to_dict() for g in still])
            elif not still:
                e.held_by.clear()
        return found

    async def _attribution_loop(self) -> None:
        while not self._stopping:
            try:
                await self.attribute_once()
            except Exception:  # noqa: BLE001 - attribution is advisory
                log.exception("GPU process attribution failed")
            await asyncio.sleep(ATTRIBUTION_INTERVAL)

    # -- loops ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Poll every engine on its own cadence until cancelled."""
        self._stopping = False
        self._running = True
        self._tasks = {e.cfg.name: asyncio.create_task(self._engine_loop(e), name=f"engine:{e.cfg.name}")
                       for e in self._engines.values()}
        if self.attribution is not None:
            self._tasks[" attribution"] = asyncio.create_task(self._attribution_loop(), name="engines:attribution")
        self._tasks[" lapses"] = asyncio.create_task(self.lapses.run(), name="engines:lapses")
        try:
            # asyncio.wait, not gather: cancelling run() must not wait for the loops first.
            # Re-read each turn: a reload adds and removes loops.
            while True:
                current = set(self._tasks.values())
                if not current:
                    await asyncio.sleep(0.5)
                    continue
                done, _ = await asyncio.wait(current, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        t.result()
                    self._tasks = {n: x for n, x in self._tasks.items() if x is not t}
        finally:
            self._running = False
            tasks = list(self._tasks.values())
            # A cancellation can be swallowed inside httpx/anyio's connect machinery (a
            # connect to a frozen engine): the flag ends such a loop at its next turn.
            self._stopping = True
            for t in tasks:
                t.cancel()
            # Bounded: a poll stuck in an HTTP exchange with a half-dead engine must not
            # hold the daemon's shutdown (or a test) forever.
            done, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT) if tasks else (set(), set())
            if pending:
                log.error("engine watchdog: %d engine loop(s) did not stop within %g s: %s", len(pending),
                          CLOSE_TIMEOUT, ", ".join(t.get_name() for t in pending))
            await self.aclose()

    async def aclose(self) -> None:
        if self.incidents is not None:
            await self.incidents.aclose()
        for e in self._engines.values():
            try:
                await asyncio.wait_for(e.probe.aclose(), CLOSE_TIMEOUT)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - closing is best effort
                log.error("engine %s: HTTP client did not close cleanly: %s", e.cfg.name, type(exc).__name__)

    async def poll_once(self, now: float | None = None) -> dict[str, EngineSnapshot]:
        """One poll of every engine, concurrently; returns the new snapshots."""
        await asyncio.gather(*(self._poll(e, now) for e in self._engines.values()))
        return self.snapshots()

    async def _engine_loop(self, e: _Engine) -> None:
        next_at = time.monotonic()
        while not self._stopping:
            interval = e.cfg.poll_interval  # a reload may change it
            try:
                await self._poll(e, None)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad poll must not end the watch
                log.exception("engine %s: poll failed", e.cfg.name)
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:  # a slow poll (timeouts, a kill) skips ticks rather than bunching them
                next_at = time.monotonic()
                delay = 0
            await asyncio.sleep(delay)

    # -- one poll ------------------------------------------------------------------------
    async def _poll(self, e: _Engine, now: float | None) -> None:
        cfg = e.cfg
        error = None
        try:
            # /proc reads of a process stuck in D state can block: bounded, in a thread.
            procs = await asyncio.wait_for(asyncio.to_thread(resolve, cfg), RESOLVE_TIMEOUT)
        except ProcessLookupFailed as exc:
            procs, error = None, str(exc)
        except asyncio.TimeoutError:
            procs = e.procs  # keep the last known processes rather than declare it down
            error = (f"process lookup took over {RESOLVE_TIMEOUT:g} s (a process in D state?); "
                     "using the last known PIDs")
        e.procs = procs
        probe = await e.probe.poll()
        # The observation's time is when its answers were in (or given up on): a probe that
        # waited out its timeout tells nothing about the moments before it gave up.
        now = self._clock() if now is None else now
        unobserved = self._unobserved(e)
        if procs is None and probe.health == "ready" and error is None:
            m = cfg.process
            how = (f"systemd unit {m.systemd_unit}" if m.systemd_unit else
                   f"pid file {m.pid_file}" if m.pid_file else f"cmdline /{m.cmdline}/")
            error = f"{cfg.url} answers but no process was found by {how}; check engines.{cfg.name}.process"
        obs = Observation(
            time=now, pid=procs.main_pid if procs else None, pid_start=procs.main_start if procs else None,
            health=probe.health if procs else None, reading=probe.reading if procs else None,
            metrics_error=probe.metrics_error if procs else None,
            cpu_seconds=procs.gpu_stat.cpu_seconds if procs else None,
            process_state=procs.gpu_stat.state if procs else None,
            batch_tokens=procs.batch_tokens if procs else None, unobserved=unobserved)
        async with e.lock:
            if unobserved:
                self._watch_gap(e, unobserved)
            v = e.tracker.observe(obs)
            e.polls += 1
            prev = e.snapshot
            self._remember(e, v, probe, now)
            e.snapshot = self._snapshot(e, v, probe, procs, now, error)
            await self._transitions(e, prev, v, probe, procs, now)
            if e.snapshot.last_action != e.last_action:  # an action taken in this poll
                e.snapshot = replace(e.snapshot, last_action=e.last_action)
        if e.last_cache_scan is None or now - e.last_cache_scan >= cfg.cache_scan_interval:
            await self._scan_caches(e, now)
        if procs is None:
            e.exposure.forget()
        elif e.exposure.due(now, v.new_pid or v.became_ready):
            for x in await e.exposure.update(cfg, procs.pids, now):
                self._event(e, "engine_exposed", "warning", f"engine {cfg.name} {x.sentence()}",
                            address=x.listener.endpoint, detail=x.detail)

    def _unobserved(self, e: _Engine) -> float:
        """Seconds of unobserved time (engines/lapses.py) since this engine's previous
        observation, the one this observation may have spanned included."""
        self.lapses.note()
        seen, e.unobserved_seen = e.unobserved_seen, self.lapses.total
        return 0.0 if seen is None else self.lapses.total - seen

    def _watch_gap(self, e: _Engine, seconds: float) -> None:
        """Nobody watched this engine for `seconds`: its stall clock restarts at this poll
        (engines/stall.py); a stall declared before is judged afresh, and a pause in
        progress cannot be measured across the gap."""
        was = e.episode
        e.episode = e.episode_at = None
        e.pause = None
        last = self.lapses.last or {}
        how = ("the host was suspended" if last.get("suspended", 0) >= last.get("late", 0) else
               "the daemon did not run (stopped, a paused VM, or its loop held up)")
        self._event(e, "engine_watch_gap", "warning",
                    f"engine {e.cfg.name}: not observed for {seconds:.1f} s ({how}); that time is not counted as "
                    "lack of progress: its stall clock restarts now"
                    + (f" (the {was} stall declared before is judged afresh)" if was else ""),
                    unobserved_seconds=round(seconds, 3), lapse=dict(last), episode_dropped=was)

    def _remember(self, e: _Engine, v: Verdict, probe: ProbeResult, now: float) -> None:
        """The readings an incident bundle carries, and pause bookkeeping: a
        no-progress period that ends with progress (not a kill, not a restart) is a pause."""
        gpu_now: dict = {}
        if self.gpu_telemetry is not None and self._gpu_names(e):
            try:
                gpu_now = dict(self.gpu_telemetry(self._gpu_names(e)) or {})
            except Exception:  # noqa: BLE001 - telemetry is optional here
                gpu_now = {}
        e.samples.append({"t": now, "state": v.state, "health": probe.health, "health_detail": probe.health_detail,
                          "metrics_error": probe.metrics_error,
                          "reading": asdict(probe.reading) if probe.reading is not None else None,
                          "no_progress_seconds": round(v.no_progress_seconds, 3),
                          "tokens_per_second": v.tokens_per_second, "reason": v.reason,
                          **({"gpu": gpu_now} if gpu_now else {})})
        while e.samples and e.samples[0]["t"] < now - SAMPLE_WINDOW:
            e.samples.popleft()
        if probe.metrics_text is not None:
            e.raw.append({"t": now, "metrics": probe.metrics_text[:200_000]})
        pause_min = max(1.0, 2 * e.cfg.poll_interval)
        if v.state in ("down", "starting") or v.new_pid:
            e.pause = None
            return
        if v.no_progress_seconds >= pause_min or (v.stalled and v.no_progress_seconds > 0):
            if e.pause is None:
                r = v.reading
                e.pause = {"start": now - v.no_progress_seconds, "running": r.running if r else None,
                           "waiting": r.waiting if r else None, "gpu": {}, "worst_state": v.state}
            if v.state in ("stalled", "unhealthy"):
                e.pause["worst_state"] = v.state
            for gpu, t in gpu_now.items():
                e.pause["gpu"].setdefault(gpu, []).append(t)
        elif v.no_progress_seconds == 0 and e.pause is not None and v.state in ("busy", "idle"):
            p, e.pause = e.pause, None
            seconds = now - p["start"]
            gpus = {}
            for gpu, ts in p["gpu"].items():
                busy = [t["busy_ratio"] for t in ts if t.get("busy_ratio") is not None]
                power = [t["power_watts"] for t in ts if t.get("power_watts") is not None]
                gpus[gpu] = {"busy_ratio_mean": sum(busy) / len(busy) if busy else None,
                             "power_watts_mean": sum(power) / len(power) if power else None}
            rec = {"start": p["start"], "seconds": round(seconds, 3), "running": p["running"],
                   "waiting": p["waiting"], "worst_state": p["worst_state"], "gpus": gpus}
            e.pauses.append(rec)
            e.pause_sum += seconds
            e.pause_count += 1
            for i, b in enumerate(PAUSE_BUCKETS):
                if seconds <= b:
                    e.pause_buckets[i] += 1
            self._event(e, "engine_pause", "info" if p["worst_state"] not in ("stalled", "unhealthy") else "warning",
                        f"engine {e.cfg.name}: no progress for {seconds:.1f} s, then progress again by itself"
                        f" (running {rec['running']}, waiting {rec['waiting']})", pause=rec)

    def exposures(self) -> dict[str, tuple[Exposure, ...]]:
        """engine -> its sockets bound beyond loopback at the last check, with their verdicts."""
        return {n: e.exposure.exposures for n, e in self._engines.items()}

    def pause_histograms(self) -> dict[str, tuple[list[int], float, int]]:
        """engine -> (cumulative bucket counts for PAUSE_BUCKETS, sum, count)."""
        return {n: (list(e.pause_buckets), e.pause_sum, e.pause_count) for n, e in self._engines.items()}

    @staticmethod
    def _longest_pause_today(e: _Engine, now: float) -> float | None:
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        today = [p["seconds"] for p in e.pauses if time.strftime("%Y-%m-%d", time.gmtime(p["start"])) == day]
        return max(today) if today else None

    def _snapshot(self, e: _Engine, v: Verdict, probe: ProbeResult, procs: EngineProcesses | None,
                  now: float, error: str | None) -> EngineSnapshot:
        r = v.reading
        ev = dict(v.evidence)
        if procs is not None:
            ev.update(pids=list(procs.pids), gpu_pid=procs.gpu_pid, gpu_process_state=procs.gpu_stat.state)
            if e.gpu_holders:
                ev["gpu_processes"] = [g.to_dict() for g in e.gpu_holders]
            if procs.note:
                ev["process_note"] = procs.note
        ev["health_detail"] = probe.health_detail
        return EngineSnapshot(
            name=e.cfg.name, kind=e.cfg.kind, state=v.state, pid=procs.main_pid if procs else None,
            requests_running=r.running if r else None, requests_waiting=r.waiting if r else None,
            generated_tokens_total=r.tokens if r else None, heartbeat=r.heartbeat if r else None,
            tokens_per_second=v.tokens_per_second, no_progress_seconds=v.no_progress_seconds,
            decode_gap_seconds=v.decode_gap_seconds, stalled=v.stalled, cpu_percent=v.cpu_percent,
            last_action=e.last_action, time_to_ready_seconds=v.time_to_ready, url=e.cfg.url,
            gpus=self._gpu_names(e), gpu_pid=procs.gpu_pid if procs else None, reason=v.reason,
            health=probe.health if procs else None, metrics_error=probe.metrics_error if procs else None,
            stall_window_seconds=v.stall_window, polled_at=now, polls=e.polls, error=error, evidence=ev,
            pauses=e.pause_count, longest_pause_today_seconds=self._longest_pause_today(e, now),
            last_incident=e.last_incident)

    async def _transitions(self, e: _Engine, prev: EngineSnapshot | None, v: Verdict, probe: ProbeResult,
                           procs: EngineProcesses | None, now: float) -> None:
        cfg = e.cfg
        self._restart_outcome(e, v, procs, now)
        if v.new_pid and procs is not None:
            self._event(e, "engine_started", "info", f"engine {cfg.name} started as PID {procs.main_pid}",
                        pid=procs.main_pid)
            if e.ledger.record_start(procs.main_start or now):
                await self._restart_loop(e, now)
        if v.became_ready:
            ttr = v.time_to_ready
            self._event(e, "engine_ready", "info",
                        f"engine {cfg.name} ready" + (f" {ttr:.1f} s after PID start" if ttr is not None else ""),
                        time_to_ready_seconds=ttr)
        if v.state == "down" and prev is not None and prev.state != "down":
            self._event(e, "engine_down", "warning", f"engine {cfg.name}: no process", last_state=prev.state)
        if v.state in ("stalled", "unhealthy") and v.reason:
            if e.episode is None:
                e.episode, e.episode_at, e.dumped, e.acted = v.reason, now, False, False
                await self._on_bad(e, v, procs, now)
            e.episode = v.reason
            await self._graded(e, v, procs, now)
        elif v.state not in ("stalled", "unhealthy"):
            if e.episode is not None and v.state in ("busy", "idle"):
                held = now - (e.episode_at or now)
                self._event(e, "engine_recovered", "info", f"engine {cfg.name} progressing again"
                            + ("" if e.acted else f" {held:.1f} s after the stall was declared, before kill_after: "
                               "recorded, not killed"))
            e.episode = None
            e.episode_at = None

    async def _on_bad(self, e: _Engine, v: Verdict, procs: EngineProcesses | None, now: float) -> None:
        """The stall is declared: alert (and start collecting: the readings are kept)."""
        cfg = e.cfg
        kind = "engine_stalled" if v.state == "stalled" else "engine_unhealthy"
        if v.state == "stalled":
            self._stalls[(cfg.name, v.reason or "stalled")] += 1
        evidence = dict(e.snapshot.evidence) if e.snapshot else dict(v.evidence)
        later = cfg.effective_kill_after - cfg.stall_after
        msg = (f"engine {cfg.name} {v.state}: {v.reason} (no progress {v.no_progress_seconds:.1f} s, "
               f"window {v.stall_window:.1f} s, running {evidence.get('running')}, "
               f"waiting {evidence.get('waiting')}, cpu {evidence.get('cpu_percent')} %)"
               + (f"; {cfg.action} in {later:g} s unless it recovers" if later > 0 and cfg.action != "alert" else ""))
        self._event(e, kind, "alert", msg, reason=v.reason, evidence=evidence)

    async def _graded(self, e: _Engine, v: Verdict, procs: EngineProcesses | None, now: float) -> None:
        """The graded response: bundle at dump_after, act at kill_after (offsets from the
        declaration, which came at stall_after, or later where a prompt batch stretched
        the bound)."""
        cfg = e.cfg
        since = now - (e.episode_at or now)
        jitter = 0.1 * cfg.poll_interval
        evidence = dict(e.snapshot.evidence) if e.snapshot else dict(v.evidence)
        due = not e.acted and since >= cfg.effective_kill_after - cfg.stall_after - jitter
        action = cfg.action
        if v.state == "unhealthy" and not cfg.act_on_unhealthy:
            action = "alert"
        if not e.dumped and since >= cfg.effective_dump_after - cfg.stall_after - jitter and procs is not None:
            # the action in this same poll would leave the stacks nothing to read
            evidence = await self._dump(e, procs, v.reason or "stalled", evidence, now,
                                        before_action=due and action != "alert")
        if not due:
            return
        e.acted = True
        if action == "alert" or procs is None:
            e.last_action = f"alert ({v.reason})"
            return
        if action == "kill":
            await self._kill(e, procs, v.reason or "stalled", evidence, now)
        else:
            await self._restart(e, procs, v.reason or "stalled", evidence, now)

    async def _dump(self, e: _Engine, procs: EngineProcesses, reason: str, evidence: dict, now: float,
                    before_action: bool = False) -> dict:
        """Take the incident bundle: the process snapshot now (bounded; before an action
        the Python stacks too), the rest in the background (incidents.py); never more
        than one per episode. -> the evidence, with the GPU's side of the stall in words
        where known (`gpu_during_stall`)."""
        e.dumped = True
        if self.incidents is None:
            return evidence
        cfg = e.cfg
        hang = self._hang_evidence(e, evidence, now)
        if hang:
            evidence = {**evidence, "gpu_during_stall": hang}
        decision = {"engine": cfg.name, "kind": cfg.kind, "reason": reason, "time": now, "action": cfg.action,
                    "episode_declared_at": e.episode_at, "evidence": evidence,
                    "graded": {"stall_after": cfg.stall_after, "dump_after": cfg.effective_dump_after,
                               "kill_after": cfg.effective_kill_after},
                    "pause_in_progress": dict(e.pause) if e.pause else None}
        samples = list(e.samples) + [{"raw_metrics": r} for r in e.raw]
        try:
            bundle = await self.incidents.begin(cfg.name, now, decision, list(procs.pids), samples,
                                                list(self._gpu_names(e)), SAMPLE_WINDOW, before_action=before_action)
        except Exception:  # noqa: BLE001 - evidence is best effort; the action must go on
            log.exception("engine %s: incident bundle failed", cfg.name)
            return evidence
        e.last_incident = bundle.path.name
        self._event(e, "engine_incident", "info", f"engine {cfg.name}: incident bundle {bundle.path}"
                    + (f"; {hang}" if hang else ""), path=str(bundle.path), notes=list(bundle.notes))
        return evidence

    @staticmethod
    def _hang_evidence(e: _Engine, evidence: dict, now: float) -> str | None:
        """The GPU's side of the no-progress period (from the poll before it on), in words,
        where telemetry was read: busy at 100 % while its power fell and no token came is a
        hang on the GPU (INCIDENTS §1), not a slow step. None without a no-progress period
        (a kernel hook's or the API's kill of a progressing engine) or telemetry."""
        flat = evidence.get("no_progress_seconds") or evidence.get("progress_flat_seconds")
        if not isinstance(flat, (int, float)) or flat <= 0:
            return None
        since = now - flat - 1.01 * e.cfg.poll_interval
        per_gpu: dict[str, list[dict]] = {}
        for sample in e.samples:
            if sample["t"] >= since:
                for gpu, t in (sample.get("gpu") or {}).items():
                    per_gpu.setdefault(gpu, []).append(t)
        parts = []
        for gpu, ts in per_gpu.items():
            busy = [t["busy_ratio"] for t in ts if t.get("busy_ratio") is not None]
            power = [t["power_watts"] for t in ts if t.get("power_watts") is not None]
            if not busy and not power:
                continue
            words = f"GPU {gpu}"
            if busy:
                words += (f" busy {min(busy) * 100:.0f} %" if min(busy) == max(busy) else
                          f" busy {min(busy) * 100:.0f}–{max(busy) * 100:.0f} %")
            if len(power) >= 2 and power[-1] < 0.9 * power[0]:
                words += f" while its power fell {power[0]:.0f} → {power[-1]:.0f} W"
            elif power:
                words += f" at {power[-1]:.0f} W"
            parts.append(words)
        if not parts:
            return None
        return "; ".join(parts) + f"; no token came for {flat:.1f} s"

    # -- actions -------------------------------------------------------------------------
    async def _kill(self, e: _Engine, procs: EngineProcesses, reason: str, evidence: dict, now: float,
                    who: str = "policy") -> KillResult:
        cfg = e.cfg
        if not e.dumped or e.episode is None:  # per kill: API and kernel kills too
            evidence = await self._dump(e, procs, reason, evidence, now, before_action=True)
        result = await kill_engine(procs.pids, cfg.grace, cgroup=procs.cgroup)
        self._actions[(cfg.name, "kill", reason)] += 1
        e.last_action = f"kill ({reason})"
        why_not = ([f"still alive: {list(result.survivors)}"] if result.survivors else []) + (
            [f"not signalled: {'; '.join(result.refused)}"] if result.refused else [])
        self._audit(e, "kill", reason, who, evidence, result.to_dict(), now, "gone" if result.gone else "not gone",
                    "; ".join(why_not))
        sev = "critical" if not result.gone else "alert"
        how = "SIGTERM then SIGKILL" if result.escalated else "SIGTERM"
        self._event(e, "engine_killed", sev,
                    f"engine {cfg.name} killed ({reason}) with {how} in {result.seconds:.2f} s"
                    + ("" if not result.survivors else f"; STILL ALIVE: {list(result.survivors)}")
                    + ("" if not result.refused else f"; NOT SIGNALLED: {'; '.join(result.refused)}"),
                    reason=reason, result=result.to_dict())
        return result

    async def _restart(self, e: _Engine, procs: EngineProcesses | None, reason: str, evidence: dict,
                       now: float, who: str = "policy") -> dict:
        """Restart through the unit or the configured command, then watch for the engine to
        come back (`engine_restart_failed` when no new process is ready within ready_timeout).
        Without either (only reachable from the GPU-reset hook or the API: the config refuses
        `action: restart` without one) the engine is killed and the event says so."""
        cfg = e.cfg
        argv = restart_argv(cfg.process.systemd_unit, cfg.restart_command)
        out: dict[str, Any] = {}
        if argv is None:
            if procs is not None:
                await self._kill(e, procs, reason, evidence, now, who=who)
                out["kill"] = "killed; no systemd_unit or restart_command to restart it with"
            else:
                out["kill"] = "no process; no systemd_unit or restart_command to restart it with"
            return out
        res: CommandResult = await run_command(argv)
        out["command"] = res.to_dict()
        self._actions[(cfg.name, "restart", reason)] += 1
        e.last_action = f"restart ({reason})"
        failed = res.returncode != 0
        if failed:
            self._audit(e, "restart", reason, who, evidence, {**out, "outcome": "command failed"}, now, "failed",
                        f"restart command exited {res.returncode}" if res.returncode is not None
                        else f"restart command {res.output}", res.returncode)
            self._event(e, "engine_restart_failed", "critical",
                        f"engine {cfg.name}: restart ({reason}) command {' '.join(argv)} failed: "
                        f"{res.returncode if res.returncode is not None else res.output}", reason=reason, result=out)
            return out
        e.tracker.mark_starting()
        e.restart_pending = (now, reason, procs.main_pid if procs else None)
        waiting = f"command ran; waiting up to {cfg.ready_timeout:g} s for a new ready process"
        self._audit(e, "restart", reason, who, evidence, {**out, "outcome": waiting}, now, "ok", waiting, res.returncode)
        self._event(e, "engine_restarting", "alert",
                    f"engine {cfg.name}: restart ({reason}) with {' '.join(argv)}; waiting for it to come back",
                    reason=reason, result=out)
        return out

    def _restart_outcome(self, e: _Engine, v: Verdict, procs: EngineProcesses | None, now: float) -> None:
        """Whether the restart gpuguard made came back: a NEW process answering ready."""
        if e.restart_pending is None:
            return
        at, reason, old = e.restart_pending
        cfg = e.cfg
        if v.became_ready and procs is not None and procs.main_pid != old:
            e.restart_pending = None
            secs = now - at
            self._audit(e, "restart", reason, "policy", {}, {"outcome": "came back", "pid": procs.main_pid,
                                                             "seconds": round(secs, 3)}, now,
                        "ok", f"came back as PID {procs.main_pid} in {secs:.1f} s")
            self._event(e, "engine_restarted", "info",
                        f"engine {cfg.name} came back as PID {procs.main_pid} {secs:.1f} s after the restart ({reason})",
                        reason=reason, pid=procs.main_pid, seconds=round(secs, 3))
        elif now - at >= cfg.ready_timeout:
            e.restart_pending = None
            what = ("no process" if procs is None else
                    f"PID {procs.main_pid} not ready" if procs.main_pid != old else f"still the old PID {old}")
            self._audit(e, "restart", reason, "policy", {}, {"outcome": "did not come back", "state": what}, now,
                        "failed", f"did not come back within {cfg.ready_timeout:g} s: {what}")
            self._event(e, "engine_restart_failed", "critical",
                        f"engine {cfg.name} did not come back within {cfg.ready_timeout:g} s of the restart "
                        f"({reason}): {what}", reason=reason, state=what)

    def _gpu_names(self, e: _Engine) -> tuple[str, ...]:
        if e.cfg.gpus or self.attribution is None:
            return tuple(e.cfg.gpus)
        return tuple(self.attribution.name(b) for b in e.gpus)

    def _engines_on_gpu(self, gpu_name: str) -> list[_Engine]:
        return [e for e in self._engines.values() if gpu_name in self._gpu_names(e)]

    async def kill_engines_on_gpu(self, gpu_name: str, reason: str, evidence: dict | None = None) -> dict[str, dict]:
        """Kernel hook: gpu_hang / sq_interrupt / device_lost on `gpu_name` kills every engine
        using that GPU at once, whatever its configured action. -> {engine: kill result}."""
        out: dict[str, dict] = {}
        now = self._clock()

        async def one(e: _Engine) -> None:
            async with e.lock:
                try:
                    procs = await asyncio.to_thread(resolve, e.cfg)
                except ProcessLookupFailed as exc:  # not "gone": nothing was signalled
                    out[e.cfg.name] = {"gone": False, "refused": [str(exc)], "note": "nothing signalled"}
                    return
                if procs is None:
                    out[e.cfg.name] = {"gone": True, "note": "no process running"}
                    return
                ev = {"gpu": gpu_name, "kernel": dict(evidence or {}),
                      "snapshot": dict(e.snapshot.evidence) if e.snapshot else {}}
                res = await self._kill(e, procs, reason, ev, now)
                out[e.cfg.name] = res.to_dict()

        await asyncio.gather(*(one(e) for e in self._engines_on_gpu(gpu_name)))
        return out

    async def restart_engines_on_gpu(self, gpu_name: str, reason: str) -> dict[str, dict]:
        """After a GPU reset: restart every engine on `gpu_name` (unit/command; without one it
        is killed, and the result says so)."""
        out: dict[str, dict] = {}
        now = self._clock()

        async def one(e: _Engine) -> None:
            async with e.lock:
                procs = await asyncio.to_thread(_resolve_quiet, e.cfg)
                out[e.cfg.name] = await self._restart(e, procs, reason, {"gpu": gpu_name}, now)

        await asyncio.gather(*(one(e) for e in self._engines_on_gpu(gpu_name)))
        return out

    # -- restart loops and caches --------------------------------------------------------
    async def _scan_caches(self, e: _Engine, now: float) -> dict[str, CacheScan]:
        e.last_cache_scan = now
        scans = {}
        for cache in e.cfg.caches:
            scan = await asyncio.to_thread(scan_zero_byte, cache.path)
            self._cache_scans[cache.name] = scan
            scans[cache.name] = scan
        return scans

    async def _restart_loop(self, e: _Engine, now: float) -> None:
        cfg = e.cfg
        loop = cfg.restart_loop
        scans = await self._scan_caches(e, now)
        broken = {n: s for n, s in scans.items() if s.zero_byte_files > 0}
        self._event(e, "engine_restart_loop", "alert",
                    f"engine {cfg.name}: {loop.count} starts within {loop.window:g} s"
                    + (f"; zero-byte files in {', '.join(f'{n} ({s.zero_byte_files})' for n, s in broken.items())}"
                       if broken else "; no zero-byte cache files found"),
                    caches={n: {"path": str(s.path), "zero_byte_files": s.zero_byte_files} for n, s in scans.items()})
        if not loop.quarantine:
            return
        related_of = {c.name: c.related for c in cfg.caches}
        for name, scan in broken.items():
            reason = "restart-loop-zero-byte"
            try:
                target, related = await asyncio.to_thread(quarantine_set, scan.path, related_of.get(name, ()), reason)
            except CacheError as exc:
                self._event(e, "cache_quarantine_failed", "alert", f"cache {name}: {exc}", cache=name)
                continue
            self._actions[(cfg.name, "quarantine", reason)] += 1
            e.last_action = f"quarantine {name}"
            self._audit(e, "quarantine", reason, "policy",
                        {"cache": name, "zero_byte_files": scan.zero_byte_files, "files": scan.files,
                         "examples": list(scan.examples), "restarts": loop.count, "window_seconds": loop.window},
                        {"from": str(scan.path), "to": str(target), **({"related": related} if related else {})}, now,
                        "ok", f"renamed {scan.path} -> {target}"
                        + "".join(f", {r['from']} -> {r['to']}" for r in related if "to" in r))
            also = [f"{r['from']} -> {r['to']}" for r in related if "to" in r]
            self._event(e, "cache_quarantined", "alert",
                        f"cache {name} quarantined: {scan.path} -> {target} ({scan.zero_byte_files} zero-byte files)"
                        + (f"; with it {', '.join(also)}" if also else ""),
                        cache=name, path=str(target), related=related)
        await self._scan_caches(e, now)

    # -- sinks ---------------------------------------------------------------------------
    def _audit(self, e: _Engine, what: str, why: str, who: str, evidence: dict, result: dict, now: float,
               outcome: Outcome, detail: str = "", returncode: int | None = None) -> None:
        """Hand the action and its real outcome to the audit sink (state/audit.EngineAction)."""
        record = EngineAction(what=what, why=why, who=who, engine=e.cfg.name, kind=e.cfg.kind, outcome=outcome,
                              detail=detail, returncode=returncode, gpus=tuple(self._gpu_names(e)),
                              evidence=evidence, result=result, time=now)
        try:
            self._audit_sink(record)
        except Exception:  # noqa: BLE001 - a broken audit sink is logged, the action stands
            log.exception("engine %s: audit sink failed for %s", e.cfg.name, what)

    def _event(self, e: _Engine, kind: str, severity: str, message: str, **fields: Any) -> None:
        gpus = self._gpu_names(e)
        ev = Event(kind=kind, severity=severity, source=SOURCE, message=message,
                   gpu=gpus[0] if len(gpus) == 1 else None, engine=e.cfg.name, time=self._clock(),
                   fields={"gpus": list(gpus), **fields})
        try:
            self._publish_sink(ev)
        except Exception:  # noqa: BLE001
            log.exception("engine %s: publish failed for %s", e.cfg.name, kind)


def _resolve_quiet(cfg: EngineConfig) -> EngineProcesses | None:
    try:
        return resolve(cfg)
    except ProcessLookupFailed:
        return None

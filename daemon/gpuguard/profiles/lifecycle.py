"""Profiles in the daemon's life. Which profile a card should carry and whether that is
verified is GPU state (`state/gpus.py`: profile_state none/pending/verified/unverified/
lost); this runtime makes pending cards verified:

- start (`on_ready`, after the first poll, before READY=1): safe-mode decision, wait for
  `apply.wait_for_gpus`, then apply + verify every pending card one at a time — so engine
  units ordered `After=gpuguard.service` start on verified cards;
- every poll cycle (`on_cycle`): reconcile — a late card, a card back from lost, a card
  reset by the kernel or one that drifted (a reset restores stock silently) is pending
  and gets applied; the effective-clock check; the safe-mode heartbeat; a STATUS= note.

Every write asks `GpuStates.may_write` (lost, not answering, unnamed, stopping). Each
card's apply runs on an abandonable device thread under `apply.timeout_seconds`, so a
blocked OD file cannot hang the start or the stop; retry backoff sleeps end on SIGTERM.
A reset during an apply bumps the card's generation: the result no longer counts and the
card stays pending.
"""
from __future__ import annotations

import asyncio
import collections
import atexit
import logging
import threading
from typing import Any, Awaitable, Callable

from gpuguard.hw.device_calls import DeviceCalls
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.profiles.apply import Applier, CardResult, CardTarget, result_event
from gpuguard.profiles.drift import drift
from gpuguard.profiles.effective import effective_findings
from gpuguard.profiles.kernel_reason import KmsgReasons
from gpuguard.profiles.ledger import ProfileLedger
from gpuguard.profiles.safemode import SafeModeGuard
from gpuguard.profiles.schema import Profile, ProfilesConfig
from gpuguard.profiles.wait import wait_for_gpus
from gpuguard.state.conditions import Conditions
from gpuguard.state.audit import AuditLog, AuditUnavailable
from gpuguard.state.events import Event
from gpuguard.state.gpus import GpuStates
from gpuguard.state.hub import Hub

log = logging.getLogger("gpuguard.profiles")
VIEW = "profiles"


class Busy:
    """The cards with an apply queued or running, counted: two API applies to one card
    queue on the card lock, and the first to finish must not mark the card idle while the
    second writes (the drift check read the second's values against the first's result and
    re-applied the configured profile in the middle of a confirm window)."""

    def __init__(self) -> None:
        self._n: collections.Counter[str] = collections.Counter()

    def add(self, bdf: str) -> None:
        self._n[bdf] += 1

    def discard(self, bdf: str) -> None:
        self._n[bdf] -= 1
        if self._n[bdf] <= 0:
            del self._n[bdf]

    def __contains__(self, bdf: object) -> bool:
        return bdf in self._n


class ProfileRuntime:
    def __init__(self, cfg: ProfilesConfig, gpus: GpuStates, hub: Hub, root: SysfsRoot,
                 discover: Callable[[], Awaitable[Any]] | None = None, applier: Applier | None = None,
                 guard: SafeModeGuard | None = None, nvml: Any = None,
                 audit: AuditLog | None = None) -> None:
        self.cfg = cfg
        self.gpus = gpus
        self.hub = hub
        self.root = root
        self.discover = discover
        self.ledger = ProfileLedger()
        self.audit = audit or AuditLog.in_state_dir(cfg.state_dir)
        self._stop = threading.Event()  # ends retry backoff sleeps in apply threads at SIGTERM
        a = cfg.apply
        self.applier = applier or self._applier(root, gpus, nvml)
        self.guard = guard or SafeModeGuard(cfg.state_dir, root, a.safe_mode_window_seconds, a.safe_mode_after_crashes)
        self.calls = DeviceCalls("gpuguard-apply")
        # Debounce: a clock must contradict for two polls in a row before it alerts (a
        # poll in flight during an apply may read the clock of the old setting once).
        self.clock_conditions = Conditions(raise_after=2, clear_after=1)
        self.ready = False
        self.safe = False
        self.busy = Busy()  # bdfs with an apply queued or running
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()

    def _applier(self, root: SysfsRoot, gpus: GpuStates, nvml: Any) -> Any:
        """amdgpu through sysfs; with an NVML source (`nvml`: hw/nvml.NvmlSource) NVIDIA
        cards through NVML — the same gate (`may_write`), retries, audit and CardResult."""
        a = self.cfg.apply
        amd = Applier(root, audit=self.audit.profile_record, kernel_reason=KmsgReasons(root), retries=a.retries,
                      backoff=a.backoff_seconds, sleep=self._sleep, may_write=self._may_write)
        if nvml is None:
            return amd
        from gpuguard.profiles.nvidia import NvmlApplier, VendorApplier

        nv = NvmlApplier(nvml.nvml, audit=self.audit.profile_record, retries=a.retries, backoff=a.backoff_seconds,
                         sleep=self._sleep, is_lost=lambda bdf: not self._may_write(bdf))
        return VendorApplier(amd, nv, discover=nvml.discover)

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _may_write(self, bdf: str) -> bool:
        # an apply abandoned by apply.timeout_seconds was reported unverified: when its
        # stuck write returns at last, that attempt writes nothing more
        return self.gpus.may_write(bdf) and not self.calls.abandoned()

    # -- configuration ----------------------------------------------------------------------
    def configure(self, cfg: ProfilesConfig) -> None:
        """Reload: new profiles, assignments and apply settings (the GPU state owner made
        cards whose assignment changed pending)."""
        old, self.cfg = self.cfg, cfg
        a = cfg.apply
        self.applier.retries = a.retries
        self.applier.backoff = a.backoff_seconds
        self.guard.window = a.safe_mode_window_seconds  # the heartbeat's "survived" line
        # a profile whose values changed: the cards carrying it get it again
        for s in self.gpus.all():
            if s.profile and old.profiles.get(s.profile) != cfg.profiles.get(s.profile) and \
                    s.profile_state in ("verified", "unverified"):
                self.gpus.set_pending(s.bdf, f"config reloaded: profile {s.profile} changed")

    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def in_effect(self, g: Any) -> tuple[str, Profile] | None:
        """The profile on the card now: the ledger's last verified write (an apply, a
        revert, a reset); before any, the configured one only where gpuguard does not
        apply itself (`gpuguard apply` at boot)."""
        known, pname = self.ledger.profile_in_effect(g.name)
        if not known:
            if self.cfg.apply.enabled:
                return None
            s = self.gpus.get(g.bdf)
            pname = s.profile if s is not None and s.named else None
        if pname is None or pname not in self.cfg.profiles:
            return None
        return pname, self.cfg.profiles[pname]

    # -- helpers ----------------------------------------------------------------------------
    def _publish(self, event: Event | None) -> None:
        if event is not None:
            self.hub.publish(event)

    def _set_view(self) -> None:
        self.hub.set_view(VIEW, self.ledger.view())

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def on_card(self, fn: Callable[..., CardResult], target: CardTarget, *args: Any) -> CardResult:
        """Run one card operation (apply, reset) on a device thread, one card at a time,
        under `apply.timeout_seconds`. A timeout abandons the thread and says so."""
        async with self.lock():  # one card at a time
            if not self.gpus.may_write(target.bdf):
                return CardResult(target.name, target.bdf, str(args[0]) if args and isinstance(args[0], str) else "?",
                                  "lost", False, f"{target.name} ({target.bdf}) may not be written now; nothing written")
            timeout = self.cfg.apply.timeout_seconds
            try:
                return await self.calls.run(fn, target, *args, timeout=timeout)
            except asyncio.TimeoutError:
                msg = (f"apply on {target.name} ({target.bdf}) did not finish within {timeout:g} s "
                       "(apply.timeout_seconds): the card is not answering; abandoned")
                log.error("%s", msg)
                return CardResult(target.name, target.bdf, str(args[0]) if args and isinstance(args[0], str) else "?",
                                  "error", False, msg, errors=(msg,))

    def record(self, r: CardResult, generation: int | None = None) -> None:
        self.ledger.record(r)
        self._publish(result_event(r))
        if r.written:
            self.guard.record_apply()
        if generation is not None and r.result != "dry-run":
            if not self.gpus.profile_result(r.bdf, generation, r.verified):
                log.info("gpu=%s bdf=%s was reset or came back during the apply: still pending", r.gpu, r.bdf)
        self._set_view()

    async def apply_one(self, bdf: str, who: str, why: str, queued: bool = False) -> CardResult | None:
        """Apply the card's assigned profile (from the GPU state) and verify it. `queued`:
        the caller marked the card busy when it spawned this (no second apply queued behind it)."""
        if not queued:
            self.busy.add(bdf)
        try:
            s = self.gpus.get(bdf)
            if s is None or s.profile is None or not self.gpus.may_write(bdf):
                return None
            profile = self.cfg.profiles.get(s.profile)
            if profile is None:
                return None
            generation = s.generation
            try:  # no audit record, no write
                await asyncio.get_running_loop().run_in_executor(None, self.audit.profile_started, s.name, s.profile, who, why)
            except AuditUnavailable as e:
                log.error("profile %s not applied to %s: %s", s.profile, s.name, e)
                self._publish(Event("audit_unavailable", "alert", "profiles",
                                    f"profile {s.profile} not applied to {s.name}: {e}", gpu=s.name, bdf=bdf))
                return None
            r = await self.on_card(self.applier.apply, CardTarget(s.name, bdf), s.profile, profile, who, why)
        finally:
            self.busy.discard(bdf)
        self.record(r, generation)
        return r

    # -- hooks ------------------------------------------------------------------------------
    async def on_ready(self) -> None:
        atexit.register(self.guard.record_clean_stop)
        decision = self.guard.decide()
        if decision.safe:
            self.safe = True
            self.ledger.safe_mode = decision.reason
            self._publish(Event("profiles_safe_mode", "critical", "profiles", decision.reason))
            self._set_view()
            self.ready = True
            return
        a = self.cfg.apply
        if not a.enabled:
            self.ready = True
            return
        if a.wait_for_gpus:
            async def look():
                if self.discover is not None:
                    await self.discover()
                return [s.name for s in self.gpus.present()], [m.name for m in self.gpus.missing()]

            w = await wait_for_gpus(look, a.wait_for_gpus, a.wait_timeout_seconds)
            self.ledger.wait_message = w.message()
            if not w.complete:
                self._publish(Event("gpus_missing", "alert", "profiles", w.message(),
                                    fields={"missing": list(w.missing), "wanted": w.wanted}))
            log.info("profiles: %s", w.message())
        for s in self.gpus.pending():
            if self._stop.is_set():
                break
            await self.apply_one(s.bdf, "policy", f"daemon start: profile {s.profile} assigned to {s.name}")
        self.ready = True
        self._set_view()

    def reconcile(self) -> None:
        """Apply every pending card that may be written (late, back, reset, drifted)."""
        if not self.ready or self.safe or not self.cfg.apply.enabled or self._stop.is_set():
            return
        for s in self.gpus.pending():
            if s.bdf in self.busy:
                continue
            self.busy.add(s.bdf)
            self._spawn(self.apply_one(s.bdf, "policy", f"GPU {s.name}: {s.pending_why or 'profile pending'}", queued=True))

    def on_cycle(self, snap: Any) -> None:
        if self.ready and not self.safe:
            self.guard.heartbeat()
            if self.cfg.apply.enabled and self.cfg.apply.drift_check:
                self._check_drift(snap)
            self.reconcile()
            if self.cfg.apply.effective_check:
                on_card = {g.name: p for g in snap.gpus if (p := self.in_effect(g))}
                observed, findings, compared = effective_findings(
                    snap.gpus, on_card, self.cfg.apply.effective_busy_ratio, self.cfg.apply.effective_tolerance_ratio)
                self.ledger.set_effective(
                    {g: (on_card[g][0] if g in on_card else "", mhz) for g, mhz in observed.items()}, findings,
                    compared)
                # One event when a clock finding starts, one when it ends.
                for ev in self.clock_conditions.update({
                    (x.gpu, x.kind): Event(f"clock_{x.kind}", "warning", "profiles", x.message, gpu=x.gpu,
                                           fields={"peer": x.peer, "observed_mhz": round(x.observed_mhz),
                                                   "reference_mhz": round(x.reference_mhz)})
                    for x in self.ledger.finding_list()
                }):
                    self._publish(ev)
        for g in snap.gpus:
            if self.gpus.is_lost(g.bdf):
                self.ledger.mark_lost(g.name)
        self._set_view()
        # systemd's STATUS= line (and /v1/status's summary) name unverified GPUs
        self.hub.notes["profiles"] = self.status_note()

    def _check_drift(self, snap: Any) -> None:
        for g in snap.gpus:
            s = self.gpus.get(g.bdf)
            if s is None or g.bdf in self.busy or s.profile_state != "verified" or not self.gpus.may_write(g.bdf):
                continue
            expected = self.ledger.expected(s.name)
            if not expected:
                continue
            d = drift(g, expected)
            if not d:
                continue
            what = ", ".join(f"{k} {want}→{now}" for k, (want, now) in d.items())
            self._publish(Event("profile_drift", "warning", "profiles",
                                f"{s.name} ({g.bdf}) no longer has profile {s.profile}: {what} "
                                "(a GPU reset restores stock settings); re-applying", gpu=s.name, bdf=g.bdf,
                                fields={"drift": {k: [w, n] for k, (w, n) in d.items()}}))
            self.gpus.set_pending(g.bdf, f"drift: {what}")
            self.busy.add(g.bdf)
            self._spawn(self.apply_one(g.bdf, "policy", f"drift: {what}", queued=True))

    def status_note(self) -> str:
        if self.ledger.safe_mode:
            return "profiles: SAFE MODE"
        bad = [r for r in self.ledger.unverified() if (s := self.gpus.get(r.bdf)) is not None and s.name == r.gpu
               and s.profile_state == "unverified"]
        if bad:
            return "profile unverified: " + ", ".join(f"{r.gpu} ({r.result})" for r in bad)
        return ""

    # -- stop -------------------------------------------------------------------------------
    def begin_stop(self) -> None:
        """SIGTERM: no new apply, backoff sleeps end, running device calls are abandoned."""
        self._stop.set()
        for t in list(self._tasks):
            t.cancel()
        self.calls.close()

    def close(self) -> None:
        if self.ready:
            self.guard.record_clean_stop()


__all__ = ["ProfileRuntime", "Profile"]

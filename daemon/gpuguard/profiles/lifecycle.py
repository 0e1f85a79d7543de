"""Profiles in the daemon's life: `attach(daemon)` wires the profile feature into a
`Daemon` without the daemon knowing about it.

- `on_ready` hook (runs after the first poll, before READY=1): safe-mode decision, wait
  for `apply.wait_for_gpus`, apply + verify every assigned GPU one at a time — so engine
  units ordered `After=gpuguard.service` start on verified cards (issue: boot ordering).
- `poller.on_appear`: a late card (or one back from lost) gets its profile.
- `poller.on_cycle`: drift check (re-apply a card that reverted, with an event),
  effective-clock check, the safe-mode heartbeat, and a STATUS= note naming unverified GPUs.
- a metrics producer and the hub view `profiles` (status/API).
"""
from __future__ import annotations

import asyncio
import atexit
import logging
from typing import Any

from gpuguard.profiles.apply import Applier, CardResult, CardTarget, result_event
from gpuguard.profiles.audit import AuditLog, audit_path
from gpuguard.profiles.drift import drift
from gpuguard.profiles.effective import effective_findings
from gpuguard.profiles.kernel_reason import KmsgReasons
from gpuguard.profiles.ledger import ProfileLedger
from gpuguard.profiles.safemode import SafeModeGuard
from gpuguard.profiles.schema import Profile, ProfilesConfig
from gpuguard.profiles.wait import wait_for_gpus
from gpuguard.state.events import Event
from gpuguard.state.identity import missing_names

log = logging.getLogger("gpuguard.profiles")
VIEW = "profiles"


class ProfileRuntime:
    def __init__(self, daemon: Any, applier: Applier | None = None, guard: SafeModeGuard | None = None) -> None:
        self.daemon = daemon
        self.cfg = ProfilesConfig.from_root(daemon.config)
        a = self.cfg.apply
        self.ledger = ProfileLedger()
        self.audit = AuditLog(audit_path(self.cfg.state_dir))
        self.applier = applier or Applier(
            daemon.root, audit=self.audit, kernel_reason=KmsgReasons(daemon.root), retries=a.retries,
            backoff=a.backoff_seconds, is_lost=lambda bdf: bdf in daemon.poller.lost or daemon.hub.is_lost(bdf),
        )
        self.guard = guard or SafeModeGuard(self.cfg.state_dir, daemon.root, a.safe_mode_window_seconds,
                                            a.safe_mode_after_crashes)
        self.ready = False
        self.safe = False
        self.busy: set[str] = set()
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- helpers --------------------------------------------------------------------------
    def assigned(self, gpu: str) -> tuple[str, Profile] | None:
        pname = self.cfg.assignments.get(gpu)
        return None if pname is None else (pname, self.cfg.profiles[pname])

    def _publish(self, event: Event | None) -> None:
        if event is not None:
            self.daemon.hub.publish(event)

    def _set_view(self) -> None:
        self.daemon.hub.set_view(VIEW, self.ledger.view())

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def apply_one(self, bdf: str, gpu: str, who: str, why: str) -> CardResult | None:
        a = self.assigned(gpu)
        if a is None:
            return None
        pname, profile = a
        assert self._lock is not None
        self.busy.add(gpu)
        try:
            async with self._lock:  # one card at a time
                loop = asyncio.get_running_loop()
                r = await loop.run_in_executor(None, self.applier.apply, CardTarget(gpu, bdf), pname, profile, who, why)
        finally:
            self.busy.discard(gpu)
        self.ledger.record(r)
        self._publish(result_event(r))
        if r.written:
            self.guard.record_apply()
        self._set_view()
        return r

    # -- hooks ----------------------------------------------------------------------------
    async def on_ready(self) -> None:
        self._lock = asyncio.Lock()
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
        poller = self.daemon.poller
        if a.wait_for_gpus:
            async def look():
                await poller.discover()
                present = [poller.names.get(b, b) for b in sorted(poller.devices) if b not in poller.lost]
                return present, missing_names([d for _, d in poller.devices.values()], poller.gpu_entries)

            w = await wait_for_gpus(look, a.wait_for_gpus, a.wait_timeout_seconds)
            self.ledger.wait_message = w.message()
            if not w.complete:
                self._publish(Event("gpus_missing", "alert", "profiles", w.message(),
                                    fields={"missing": list(w.missing), "wanted": w.wanted}))
            log.info("profiles: %s", w.message())
        for bdf in sorted(poller.devices):
            if bdf in poller.lost:
                continue
            name = poller.names.get(bdf, bdf)
            if self.assigned(name):
                await self.apply_one(bdf, name, "policy", f"daemon start: profile {self.cfg.assignments[name]} assigned to {name}")
        self.ready = True
        self._set_view()

    def on_appear(self, bdf: str, name: str) -> None:
        if not self.ready or self.safe or not self.cfg.apply.enabled or self.assigned(name) is None:
            return  # before ready the start-up apply covers every present card
        self._spawn(self.apply_one(bdf, name, "policy", f"GPU {name} appeared (late card or back from lost)"))

    def on_cycle(self, snap: Any) -> None:
        if self.ready and not self.safe:
            self.guard.heartbeat()
            if self.cfg.apply.enabled and self.cfg.apply.drift_check:
                self._check_drift(snap)
            if self.cfg.apply.effective_check:
                assigned = {g.name: self.assigned(g.name) for g in snap.gpus if self.assigned(g.name)}
                observed, findings = effective_findings(snap.gpus, assigned, self.cfg.apply.effective_busy_ratio,
                                                        self.cfg.apply.effective_tolerance_ratio)
                self.ledger.set_effective({g: (assigned[g][0], mhz) for g, mhz in observed.items()}, findings)
        for g in snap.gpus:
            if g.bdf in self.daemon.poller.lost or self.daemon.hub.is_lost(g.bdf):
                self.ledger.mark_lost(g.name)
        self._set_view()
        # systemd's STATUS= line (and /v1/status's summary) name unverified GPUs
        self.daemon.hub.notes["profiles"] = self.status_note()

    def _check_drift(self, snap: Any) -> None:
        for g in snap.gpus:
            if g.name in self.busy or g.bdf in self.daemon.poller.lost or self.daemon.hub.is_lost(g.bdf):
                continue
            expected = self.ledger.expected(g.name)
            if not expected:
                continue
            d = drift(g, expected)
            if not d:
                continue
            what = ", ".join(f"{k} {want}→{now}" for k, (want, now) in d.items())
            self._publish(Event("profile_drift", "warning", "profiles",
                                f"{g.name} ({g.bdf}) no longer has profile {self.cfg.assignments[g.name]}: {what} "
                                "(a GPU reset restores stock settings); re-applying", gpu=g.name, bdf=g.bdf,
                                fields={"drift": {k: [w, n] for k, (w, n) in d.items()}}))
            self.busy.add(g.name)
            self._spawn(self.apply_one(g.bdf, g.name, "policy", f"drift: {what}"))

    def status_note(self) -> str:
        if self.ledger.safe_mode:
            return "profiles: SAFE MODE"
        bad = self.ledger.unverified()
        if bad:
            return "profile unverified: " + ", ".join(f"{r.gpu} ({r.result})" for r in bad)
        return ""


def attach(daemon: Any) -> ProfileRuntime:
    """Wire profiles into `daemon` (hooks, metrics, view). Returns the runtime (tests use it)."""
    rt = ProfileRuntime(daemon)
    daemon.on_ready.append(rt.on_ready)
    daemon.poller.on_appear.append(rt.on_appear)
    daemon.poller.on_cycle.append(rt.on_cycle)
    daemon.metrics.add_producer(rt.ledger.metrics)
    daemon.profiles = rt
    actions = getattr(daemon, "actions", None)
    if actions is not None:  # the control API's apply/reset/confirm-window providers
        from gpuguard.profiles.api import ProfileActions

        actions.provide_from(ProfileActions(rt))
    # After a GPU reset the card is back at stock settings (INCIDENTS §3: silently):
    # re-verify and re-apply at once rather than waiting for the drift check.
    actions = getattr(daemon, "kernel_actions", None)
    if actions is not None:
        actions.on_reset_ok.append(
            lambda gpu, bdf: rt.apply_one(bdf, gpu, "policy", "GPU reset: the card is back at stock settings") if gpu else None
        )
    return rt

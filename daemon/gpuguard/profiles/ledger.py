"""What the profile feature knows right now, per GPU: the last apply result, apply
counts by result, the effective-clock check, safe mode. The daemon's status view and the
Prometheus producer read it; only the profile lifecycle writes it (on the event loop)."""
from __future__ import annotations

import collections
import dataclasses
import threading
from types import MappingProxyType
from typing import Any, Collection, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuguard.profiles.apply import METRIC_RESULT, CardResult
from gpuguard.profiles.effective import ClockFinding


class ProfileLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.results: dict[str, CardResult] = {}  # gpu name -> last result
        self.apply_counts: collections.Counter = collections.Counter()  # (gpu, profile, result)
        self.observed_mhz: dict[str, tuple[str, float]] = {}  # gpu -> (profile, MHz under load)
        self.findings: dict[str, list[ClockFinding]] = {}
        # The profile on each card now, by the last verified write (None: stock or unknown);
        # a confirm-window revert ("restore") puts back the one before.
        self.in_effect: dict[str, str | None] = {}
        self._before: dict[str, str | None] = {}
        self.safe_mode: str | None = None
        self.wait_message: str | None = None

    def record(self, r: CardResult) -> None:
        with self._lock:
            if r.result == "dry-run":
                return
            self.results[r.gpu] = r
            self.apply_counts[(r.gpu, r.profile, METRIC_RESULT.get(r.result, "error"))] += 1
            if not r.verified:
                self.in_effect[r.gpu] = None  # what the card holds now is unknown: claim nothing
            elif r.profile == "restore":
                self.in_effect[r.gpu] = self._before.pop(r.gpu, None)
            else:
                self._before[r.gpu] = self.in_effect.get(r.gpu)
                self.in_effect[r.gpu] = None if r.profile == "stock" else r.profile
            # The inputs changed (applied, reverted, reset): no finding outlives its cause;
            # the next poll judges the card afresh.
            self._forget(r.gpu)

    def _forget(self, gpu: str) -> None:
        """Drop every finding about `gpu` or naming it as the peer (lock held)."""
        self.findings = {g: [x for x in fs if x.peer != gpu] for g, fs in self.findings.items() if g != gpu}
        self.findings = {g: fs for g, fs in self.findings.items() if fs}
        self.observed_mhz.pop(gpu, None)

    def profile_in_effect(self, gpu: str) -> tuple[bool, str | None]:
        """(known, profile name): known is False before any write was recorded for `gpu`."""
        with self._lock:
            return (gpu in self.in_effect, self.in_effect.get(gpu))

    def mark_lost(self, gpu: str) -> None:
        """A card gone from the bus has no profile in effect (it kept reporting
        verified 1): its state becomes `lost`. Not an apply, so not counted; the card gets
        its profile applied again when it comes back (lifecycle.on_appear). Its clock findings,
        and its twins' findings against it, go: a held verdict must not outlive its card."""
        with self._lock:
            self._forget(gpu)
            r = self.results.get(gpu)
            if r is not None and r.result != "lost":
                self.results[gpu] = dataclasses.replace(
                    r, result="lost", verified=False,
                    message=f"{gpu} is lost from the bus; profile {r.profile} is applied again when it comes back")

    def set_effective(self, observed: Mapping[str, tuple[str, float]], findings: Iterable[ClockFinding],
                      compared: Collection[str]) -> None:
        """This poll's verdicts. A finding not judged this poll holds: a limit finding while
        its card is not under load, a card-against-card finding while no twin is at
        comparable load (load swinging idle/busy is not a cause going away: with the
        lifecycle's clear-after-1 debounce, a twin idling every few polls cleared and raised
        INCIDENTS §3's finding again and again). It clears when a judgement shows agreement;
        `record` and `mark_lost` drop it when its cause goes."""
        with self._lock:
            def judged(x: ClockFinding) -> bool:
                return x.gpu in compared if x.kind == "card_mismatch" else x.gpu in observed

            f: dict[str, list[ClockFinding]] = {}
            for x in [x for fs in self.findings.values() for x in fs if not judged(x)] + list(findings):
                f.setdefault(x.gpu, []).append(x)
            self.findings = f
            self.observed_mhz = {**{g: v for g, v in self.observed_mhz.items() if g not in observed}, **observed}

    def finding_list(self) -> list[ClockFinding]:
        with self._lock:
            return [x for fs in self.findings.values() for x in fs]

    def unverified(self) -> list[CardResult]:
        with self._lock:
            return [r for r in self.results.values() if not r.verified]

    def expected(self, gpu: str) -> Mapping[str, Any] | None:
        r = self.results.get(gpu)
        return r.expected if r is not None and r.verified else None

    def view(self) -> Mapping[str, Any]:
        """Immutable summary for the hub (status, API)."""
        with self._lock:
            return MappingProxyType({
                "safe_mode": self.safe_mode,
                "wait": self.wait_message,
                "gpus": {g: r.to_dict() for g, r in sorted(self.results.items())},
                "findings": [x.message for fs in self.findings.values() for x in fs],
            })

    def metrics(self) -> Iterable[Metric]:
        with self._lock:
            verified = GaugeMetricFamily("gpuguard_profile_verified", "1 = the profile's values read back equal",
                                         labels=["gpu", "profile"])
            for g, r in sorted(self.results.items()):
                verified.add_metric([g, r.profile], 1.0 if r.verified else 0.0)
            yield verified
            total = CounterMetricFamily("gpuguard_profile_apply", "Profile applies by result",
                                        labels=["gpu", "profile", "result"])
            for (g, p, res), n in sorted(self.apply_counts.items()):
                total.add_metric([g, p, res], n)
            yield total
            eff = GaugeMetricFamily("gpuguard_profile_effective_clock_hertz",
                                    "SCLK observed under load on a GPU with a profile", labels=["gpu", "profile"])
            for g, (p, mhz) in sorted(self.observed_mhz.items()):
                eff.add_metric([g, p], mhz * 1e6)
            yield eff
            fin = GaugeMetricFamily("gpuguard_profile_effective_finding",
                                    "1 = the clock under load contradicts the profile, or a card of the same model",
                                    labels=["gpu", "profile", "kind"])
            twins = GaugeMetricFamily("gpuguard_gpu_clock_disagreement",
                                      "1 = this GPU runs clearly slower under load than `peer`, a card of the same "
                                      "model at comparable load (INCIDENTS §3)", labels=["gpu", "peer"])
            for g, fs in sorted(self.findings.items()):
                for x in fs:
                    fin.add_metric([g, x.profile, x.kind], 1.0)
                    if x.kind == "card_mismatch" and x.peer:
                        twins.add_metric([g, x.peer], 1.0)
            yield fin
            yield twins
            safe = GaugeMetricFamily("gpuguard_profiles_safe_mode", "1 = safe mode: no profiles applied")
            safe.add_metric([], 1.0 if self.safe_mode else 0.0)
            yield safe

"""The one owner of every GPU's state (DESIGN.md "One owner"), keyed by PCI address:
who it is (identity), whether it is present, not answering or lost and by which route,
which profile it should carry and whether that is verified (with a generation counter
bumped on every reset or return, so an apply that raced a reset cannot claim the card is
verified), which engines sit on it, its kernel counters and active conditions.

Sources report into it (discovery → `observe`, reads → `answering`/`not_answering`,
kernel lines and udev → `mark_lost`/`back`/`reset`/`kernel_event`); policy listens
(`on_lost`, `on_back`, `on_new`); everything that writes a card asks `may_write` first.
Nothing else keeps a second copy: "lost" in three sets was the bug.

One rule for "back", whatever marked the card lost (the bus, reads that failed for
`lost_after_seconds`, a kernel line, a udev remove): it reappears (on the bus again, a
udev add, a reset that succeeded), or it stays on the bus and answers every read for
`lost_after_seconds`, the same window that makes a silent card lost. A kernel-lost card
that was power-cycled back without leaving the bus stayed lost for ever while it read fine;
one good read is not enough (a read that raced the kernel's line, a dying card's last one).

Runs on the event loop; `may_write` is also called from apply threads (a read).
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from gpuguard.state.events import Event
from gpuguard.state.identity import Identity, MissingCard, PciIdentity, default_name, identify, pci_id_of

log = logging.getLogger("gpuguard.gpus")

PRESENT, NOT_ANSWERING, LOST = "present", "not_answering", "lost"
PROFILE_STATES = ("none", "pending", "verified", "unverified", "lost")
HOST = "host"  # the gpu label of kernel events that name no GPU (OOM kill, hung task)

Listener = Callable[["GpuState", str], Any]


@dataclass(frozen=True)
class GpuState:
    """One GPU, as an immutable value (a new one replaces it on every change)."""

    bdf: str
    pci_id: str
    model: str = "?"
    name: str = ""
    named: bool = False  # a configured name holds now (identity); unnamed cards are never written
    presence: str = PRESENT  # present | not_answering | lost
    on_bus: bool = True  # False: gone from discovery (the PCI device folder vanished)
    lost_by: str | None = None  # bus | not_answering | kernel:<kind> | udev
    changed: float = 0.0  # wall time of the last presence change
    not_answering_since: float | None = None  # monotonic
    answering_since: float | None = None  # monotonic: lost, and every read answered since then
    profile: str | None = None
    profile_state: str = "none"
    generation: int = 0
    why_unnamed: str | None = None
    pending_why: str = ""  # why the profile is pending: audit's "why" for the apply

    @property
    def up(self) -> bool:
        return self.presence == PRESENT

    def to_dict(self) -> dict[str, Any]:
        return {"bdf": self.bdf, "name": self.name, "named": self.named, "pci_id": self.pci_id, "model": self.model,
                "presence": self.presence, "on_bus": self.on_bus, "lost_by": self.lost_by,
                "profile": self.profile, "profile_state": self.profile_state, "generation": self.generation,
                "why_unnamed": self.why_unnamed}


@dataclass(frozen=True)
class _Dev:
    bdf: str
    vendor: str
    device_id: str


class GpuStates:
    def __init__(self, publish: Callable[[Event], None] = lambda e: None, entries: Sequence = (),
                 lost_after_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._publish = publish
        self.entries: list = list(entries)
        self.engines: dict[str, tuple[str, ...]] = {}  # engine name -> GPU names
        self.lost_after_seconds = lost_after_seconds
        self.clock = clock
        self._gpus: dict[str, GpuState] = {}
        self.identity = Identity({}, (), 0)
        self.observed = False  # a first discovery happened
        self.observed_once = False  # ... and it was not the first one
        self.stopping = False
        self.kernel_counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (gpu|host, kind)
        self.conditions: dict[tuple[str, str], Event] = {}  # (bdf|host, kind) -> the event that raised it
        self.on_lost: list[Listener] = []
        self.on_back: list[Listener] = []
        self.on_new: list[Listener] = []
        self.on_reset: list[Listener] = []  # reset while present: stock settings, every context gone
        self._missing_said: tuple[str, ...] = ()
        self._moved_from: dict[str, GpuState] = {}  # new bdf -> the card's state at its old address

    # -- configuration ---------------------------------------------------------------------
    def configure(self, entries: Sequence, engines: Mapping[str, Iterable[str]] | None = None) -> None:
        """New `gpus:` entries (start, reload). Cards whose name or profile changed are
        re-identified and, where a profile is now assigned, made pending."""
        before = {e.name: e.match for e in self.entries}
        self.entries = list(entries)
        if engines is not None:
            self.engines = {e: tuple(g) for e, g in engines.items()}
        # a card keeps the name it was identified by while that entry's match is unchanged
        self._reidentify(keep={e.name for e in self.entries if before.get(e.name) == e.match})

    def _profile_for(self, name: str) -> str | None:
        for e in self.entries:
            if e.name == name:
                return getattr(e, "profile", None)
        return None

    # -- reading ---------------------------------------------------------------------------
    def get(self, bdf: str) -> GpuState | None:
        return self._gpus.get(bdf)

    def all(self) -> list[GpuState]:
        return [self._gpus[b] for b in sorted(self._gpus)]

    def __iter__(self):
        return iter(self.all())

    def __contains__(self, bdf: object) -> bool:
        return bdf in self._gpus

    def name(self, bdf: str | None) -> str | None:
        s = self._gpus.get(bdf) if bdf else None
        return s.name if s else None

    def names(self) -> dict[str, str]:
        return {b: s.name for b, s in sorted(self._gpus.items())}

    def bdf_of(self, name: str) -> str | None:
        for b, s in self._gpus.items():
            if s.name == name or b == name:
                return b
        return None

    def is_lost(self, bdf: str) -> bool:
        s = self._gpus.get(bdf)
        return s is not None and s.presence == LOST

    def on_bus(self, bdf: str) -> bool:
        s = self._gpus.get(bdf)
        return s is not None and s.on_bus

    def present(self) -> list[GpuState]:
        return [s for s in self.all() if s.on_bus and s.presence != LOST]

    def may_write(self, bdf: str) -> bool:
        """The one answer to "may this GPU be written?": not while lost, not answering,
        gone from the bus, unnamed (identity did not hold), or the daemon stopping."""
        s = self._gpus.get(bdf)
        return (s is not None and not self.stopping and s.named and s.on_bus and s.presence == PRESENT)

    def engines_on(self, bdf_or_name: str) -> list[str]:
        s = self._gpus.get(bdf_or_name)
        name = s.name if s else bdf_or_name
        return sorted(e for e, gpus in self.engines.items() if name in gpus)

    def missing(self) -> tuple[MissingCard, ...]:
        """Configured cards with no identified present card, plus named cards that are lost
        from the bus (the boot that "found 3" for 4 configured, INCIDENTS §2)."""
        return self.identity.missing

    def summary(self) -> str:
        """The first part of systemd STATUS= and /v1/status's summary:
        `3/4 GPUs up; missing xtx-0 (1002:744c #0)`; `down: …` for cards on the bus that
        do not answer or were declared lost by the kernel."""
        if not self.observed:
            return "starting: no poll yet"
        cards = self.all()
        missing = self.missing()
        gone = {m.name for m in missing}
        total = max(self.identity.configured, len(cards))
        up = sum(1 for c in cards if c.up)
        line = f"{up}/{total} GPUs up"
        down = [c.name for c in cards if not c.up and not (not c.on_bus and c.name in gone)]
        if down:
            line += f"; down: {', '.join(down)}"
        if missing:
            line += "; missing " + ", ".join(m.label() for m in missing)
        return line

    # -- discovery -------------------------------------------------------------------------
    def observe(self, devices: Iterable[PciIdentity]) -> None:
        """The devices discovery found now (all sources). New cards are added, vanished
        ones lost (route `bus`), returned ones brought back; identity is re-run."""
        found = {d.bdf: d for d in devices}
        first = not self.observed
        self.observed = True
        self.observed_once = not first
        now = time.time()
        new: list[str] = []
        returned: list[str] = []
        for bdf, d in found.items():
            s = self._gpus.get(bdf)
            if s is None:
                self._gpus[bdf] = GpuState(bdf, pci_id_of(d), getattr(d, "model", "?"), default_name(bdf), changed=now)
                new.append(bdf)
            elif not s.on_bus:
                self._gpus[bdf] = replace(s, on_bus=True, model=getattr(d, "model", s.model))
                returned.append(bdf)
        vanished = [b for b, s in self._gpus.items() if s.on_bus and b not in found]
        for bdf in vanished:
            self._gpus[bdf] = replace(self._gpus[bdf], on_bus=False)
        self._reidentify()
        for bdf in vanished:
            if bdf in self._gpus:  # not if identified at another address in this same look
                self.mark_lost(bdf, "bus", f"GPU {self._gpus[bdf].name} ({bdf}) is gone from the PCI bus")
        for bdf in returned:
            self.back(bdf, "bus")
        for bdf in new:
            s = self._gpus[bdf]
            old = self._moved_from.pop(bdf, None)
            if old is not None:
                self._back_elsewhere(old, s)
                continue
            if not first:
                self._event("gpu_appeared", "info", f"GPU {s.name} ({bdf}) appeared", s)
            self._emit(self.on_new, s, "start" if first else "appeared")
        self._say_missing()

    def _reidentify(self, keep: set[str] | None = None) -> None:
        present = [_Dev(s.bdf, *s.pci_id.split(":")) for s in self._gpus.values() if s.on_bus]
        known = {s.bdf: s.name for s in self._gpus.values() if s.on_bus and s.named and (keep is None or s.name in keep)}
        ident = identify(present, self.entries, known)
        # a card lost from the bus keeps its last name (its series stay where they were);
        # it is reported missing when identity no longer finds it
        lost_named = {s.name: s for s in self._gpus.values() if not s.on_bus and s.named}
        for name, s in lost_named.items():
            if name in ident.names.values():
                # the card came back at another address and was identified there: the old
                # address is history; observe() reports it back (not a new card)
                del self._gpus[s.bdf]
                for b, n in ident.names.items():
                    if n == name:
                        self._moved_from[b] = s
                for key in [k for k in self.conditions if k[0] == s.bdf]:
                    del self.conditions[key]
        self.identity = ident
        for bdf, s in list(self._gpus.items()):
            if not s.on_bus:
                continue
            name = ident.names.get(bdf)
            named = name is not None
            name = name or default_name(bdf)
            profile = self._profile_for(name) if named else None
            if (name, named, profile) == (s.name, s.named, s.profile):
                if not named and s.why_unnamed != ident.unnamed_why.get(bdf):
                    self._gpus[bdf] = replace(s, why_unnamed=ident.unnamed_why.get(bdf))
                continue
            if profile is None:
                pstate = "none"
            elif s.presence == LOST:
                pstate = "lost"
            else:
                pstate = "pending"
            why = "daemon start" if not self.observed_once else (
                "GPU appeared (late card or back from lost)" if not s.named else "identity or assignment changed")
            self._gpus[bdf] = replace(s, name=name, named=named, profile=profile, profile_state=pstate,
                                      generation=s.generation + 1, why_unnamed=ident.unnamed_why.get(bdf),
                                      pending_why=why)
            if s.named or named:  # pragma: no mutate
                log.info("gpu bdf=%s identity %s → %s%s", bdf, s.name, name, "" if named else " (unnamed)")  # pragma: no mutate

    def _say_missing(self) -> None:
        labels = tuple(m.label() for m in self.identity.missing)
        if labels == self._missing_said:
            return
        self._missing_said = labels
        if labels:
            why = "; ".join(f"{m.label()}: {m.why}" for m in self.identity.missing)
            e = self._event("gpus_missing", "alert", f"configured GPU(s) missing: {why}; nothing is applied to "
                            "cards that are not identified", None, fields={"missing": [m.name for m in self.identity.missing],
                                                                          "condition": True})
            self.conditions[(HOST, "gpus_missing")] = e
        else:
            self.conditions.pop((HOST, "gpus_missing"), None)
            self._event("gpus_complete", "info", "every configured GPU is present and identified", None)

    # -- lifecycle -------------------------------------------------------------------------
    def mark_lost(self, bdf: str, by: str, message: str | None = None, quiet: bool = False, **fields: Any) -> bool:
        """A GPU is lost (route `by`: bus, not_answering, kernel:<kind>, udev). One
        `gpu_lost` event per loss; listeners run the policy (kill engines). False when it
        was lost already or is unknown."""
        s = self._gpus.get(bdf)
        if s is None:
            return False
        if s.presence == LOST:
            # said again (the kernel's `GPU Recovery Failed` lines after `device lost`): the
            # window of good reads that brings it back starts anew; the route the kernel or
            # the bus names replaces "not answering"
            self._gpus[bdf] = replace(s, lost_by=by if s.lost_by == "not_answering" else s.lost_by,
                                      answering_since=None)
            return False
        s = replace(s, presence=LOST, lost_by=by, changed=time.time(), not_answering_since=None,
                    answering_since=None, profile_state="lost" if s.profile else s.profile_state)
        self._gpus[bdf] = s
        msg = (message or f"GPU {s.name} ({bdf}) is lost ({by})") + \
            "; nothing is written to it until it is back; recovery is kill the engines, then reboot " \
            "(cold power-cycle if the reboot does not come back)"
        if not quiet:  # quiet: the caller's own `gpu_lost` event (udev remove) is the one alert
            e = self._event("gpu_lost", "critical", msg, s, fields={"route": by, "engines": self.engines_on(bdf),
                                                                     "condition": True, **fields})
            self.conditions[(bdf, "gpu_lost")] = e
        self._emit(self.on_lost, s, by)
        return True

    def back(self, bdf: str, how: str) -> bool:
        """A lost GPU is back (on the bus again, answering again, reset ok, udev add): the
        card is at stock settings, so its profile is pending again (a new generation)."""
        s = self._gpus.get(bdf)
        if s is None or s.presence != LOST or not s.on_bus:
            return False
        s = replace(s, presence=PRESENT, lost_by=None, changed=time.time(), not_answering_since=None,
                    answering_since=None, generation=s.generation + 1, profile_state="pending" if s.profile else "none",
                    pending_why=f"GPU back ({how}): stock settings")
        self._gpus[bdf] = s
        self.conditions.pop((bdf, "gpu_lost"), None)
        self._event("gpu_back", "info", f"GPU {s.name} ({bdf}) is back ({how})"
                    + ("; its profile is re-applied" if s.profile else ""), s, fields={"how": how})
        self._emit(self.on_back, s, how)
        return True

    def _back_elsewhere(self, old: GpuState, s: GpuState) -> None:
        """A named card came back at another address (moved to another slot, re-enumerated
        after a bus rescan) and identity named it there: the same card, back at stock
        settings. Its profile is pending (identity made it so), its engines are restarted."""
        how = f"at {s.bdf}, was {old.bdf}"
        s = replace(s, generation=max(s.generation, old.generation + 1),
                    pending_why=f"GPU back at another address ({how}): stock settings")
        self._gpus[s.bdf] = s
        log.info("gpu %s back at another address %s (was %s)", s.name, s.bdf, old.bdf)  # pragma: no mutate
        self._event("gpu_back", "info", f"GPU {s.name} is back at another address: {s.bdf} (was {old.bdf})"
                    + ("; its profile is re-applied" if s.profile else ""), s,
                    fields={"how": "bus", "previous_bdf": old.bdf, "was_lost": old.presence == LOST})
        self._emit(self.on_back, s, f"bus ({how})")

    def reset(self, bdf: str, why: str) -> None:
        """The card was reset (kernel `GPU reset succeeded`): stock settings again."""
        s = self._gpus.get(bdf)
        if s is None:
            return
        if s.presence == LOST:
            self.back(bdf, why)
            return
        self._gpus[bdf] = s = replace(s, generation=s.generation + 1,
                                      profile_state="pending" if s.profile else s.profile_state,
                                      pending_why=f"{why}: the card is back at stock settings")
        self._emit(self.on_reset, s, why)

    def not_answering(self, bdf: str, reason: str) -> None:
        s = self._gpus.get(bdf)
        if s is None or not s.on_bus:
            return
        if s.presence == LOST:
            if s.answering_since is not None:  # a lost card that failed again starts its window anew
                self._gpus[bdf] = replace(s, answering_since=None)
            return
        now = self.clock()
        if s.presence == PRESENT:
            self._gpus[bdf] = s = replace(s, presence=NOT_ANSWERING, not_answering_since=now, changed=time.time())
            self._event("gpu_not_answering", "alert", f"GPU {s.name} ({bdf}) stopped answering: {reason}", s)
        if s.not_answering_since is not None and now - s.not_answering_since >= self.lost_after_seconds:
            self.mark_lost(bdf, "not_answering", f"GPU {s.name} ({bdf}) has not answered for "
                           f"{now - s.not_answering_since:.0f} s (poll.lost_after_seconds {self.lost_after_seconds:g}): {reason}")

    def answering(self, bdf: str) -> None:
        s = self._gpus.get(bdf)
        if s is None or not s.on_bus:
            return
        if s.presence == NOT_ANSWERING:
            self._gpus[bdf] = replace(s, presence=PRESENT, not_answering_since=None, changed=time.time())
            self._event("gpu_answering", "info", f"GPU {s.name} ({bdf}) answers again", s)
        elif s.presence == LOST:
            now = self.clock()
            if s.answering_since is None:
                self._gpus[bdf] = s = replace(s, answering_since=now)
            if now - s.answering_since >= self.lost_after_seconds:
                self.back(bdf, f"answering again for {now - s.answering_since:.0f} s")

    # -- profiles --------------------------------------------------------------------------
    def set_pending(self, bdf: str, why: str = "") -> int | None:
        s = self._gpus.get(bdf)
        if s is None or s.profile is None:
            return None
        self._gpus[bdf] = replace(s, profile_state="pending" if s.presence != LOST else "lost", pending_why=why)
        return s.generation

    def profile_result(self, bdf: str, generation: int, verified: bool) -> bool:
        """Record an apply's outcome. Ignored (the card stays pending) when the card was
        reset or came back while the apply ran: what was verified is not there any more."""
        s = self._gpus.get(bdf)
        if s is None or s.generation != generation or s.presence == LOST or s.profile is None:
            return False
        self._gpus[bdf] = replace(s, profile_state="verified" if verified else "unverified")
        return True

    def card_holds(self, bdf: str, assigned: bool) -> None:
        """An apply outside the GPU's own (the API's, a confirm window's revert) read back:
        `assigned` says whether the card now holds its configured profile."""
        s = self._gpus.get(bdf)
        if s is None or s.profile is None or s.presence == LOST:
            return
        self._gpus[bdf] = replace(s, profile_state="verified" if assigned else "unverified")

    def pending(self) -> list[GpuState]:
        return [s for s in self.all() if s.profile_state == "pending" and self.may_write(s.bdf)]

    # -- kernel ----------------------------------------------------------------------------
    def kernel_event(self, e: Event, clears: Iterable[str] = ()) -> None:
        """Count a classified kernel line (GPU-less ones under gpu="host") and keep the
        conditions it raises or clears."""
        self.kernel_counts[(e.gpu or (self.name(e.bdf) if e.bdf else None) or HOST, e.kind)] += 1
        key = e.bdf or HOST
        for kind in clears:
            self.conditions.pop((key, kind), None)
        if e.fields.get("condition"):
            self.conditions[(key, e.kind)] = e

    def clear_conditions(self, bdf: str, kinds: Iterable[str]) -> None:
        for k in kinds:
            self.conditions.pop((bdf, k), None)

    # -- stop ------------------------------------------------------------------------------
    def begin_stop(self) -> None:
        """SIGTERM: from now on nothing is written (may_write is False for every card)."""
        self.stopping = True

    # -- internals -------------------------------------------------------------------------
    def _event(self, kind: str, severity: str, message: str, s: GpuState | None, fields: Mapping | None = None) -> Event:
        e = Event(kind, severity, "gpus", message, gpu=s.name if s else None, bdf=s.bdf if s else None,
                  fields=dict(fields or {}))
        self._publish(e)
        return e

    def _emit(self, listeners: list[Listener], s: GpuState, how: str) -> None:
        for fn in list(listeners):
            try:
                fn(s, how)
            except Exception:  # one broken listener must not stop the others
                log.exception("gpu state listener %s failed", getattr(fn, "__qualname__", fn))  # pragma: no mutate

    def metrics_rows(self) -> list[tuple[str, str]]:
        return [(m.name, m.match) for m in self.identity.missing]



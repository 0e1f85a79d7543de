"""Findings as conditions, not edges: a finding keyed by what it is about (check + where,
never its changing text) raises one event when it starts, none while it holds, and one
`<kind>_cleared` event when it ends — each with a debounce, so a reading that flickers
(load swinging between idle and busy, a value on a threshold) does not re-fire it
(five alerts in 2.5 minutes for one unchanged hop). Part of the event stream's state:
held by the PCIe findings (policy) and the profile runtime's clock check (a source)
alike, so it sits below both."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Hashable, Mapping

from gpuguard.state.events import Event


@dataclass
class _Held:
    event: Event  # the event that raised it (latest text kept for the clear)
    raised: bool
    seen: int  # consecutive checks present
    missing: int  # consecutive checks absent


class Conditions:
    """`update(current)` with every finding present now ({key: event}); returns the events
    to publish. A key raises after `raise_after` checks in a row, clears after
    `clear_after` checks in a row without it."""

    def __init__(self, raise_after: int = 1, clear_after: int = 2) -> None:
        self.raise_after = max(1, raise_after)
        self.clear_after = max(1, clear_after)
        self._held: dict[Hashable, _Held] = {}

    @property
    def active(self) -> frozenset:
        """Keys raised and not cleared."""
        return frozenset(k for k, h in self._held.items() if h.raised)

    def update(self, current: Mapping[Hashable, Event]) -> list[Event]:
        out: list[Event] = []
        for key, ev in current.items():
            h = self._held.get(key)
            if h is None:
                h = self._held[key] = _Held(ev, False, 0, 0)
            h.event, h.seen, h.missing = ev, h.seen + 1, 0
            if not h.raised and h.seen >= self.raise_after:
                h.raised = True
                out.append(ev)
        for key in [k for k in self._held if k not in current]:
            h = self._held[key]
            h.missing += 1
            h.seen = 0
            if not h.raised:
                del self._held[key]  # never raised: nothing to clear
            elif h.missing >= self.clear_after:
                del self._held[key]
                out.append(cleared(h.event))
        return out

    def drop(self, key: Hashable) -> Event | None:
        """End a condition at once (its cause went away for sure: a profile reverted)."""
        h = self._held.pop(key, None)
        return cleared(h.event) if h is not None and h.raised else None


def cleared(ev: Event) -> Event:
    return replace(
        ev, kind=f"{ev.kind}_cleared", severity="info", message=f"cleared: {ev.message}",
        fields={**ev.fields, "cleared": True}, time=time.time(),
    )

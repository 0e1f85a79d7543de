"""From a classified kernel record to an `Event`: owns attribution (which configured GPU a
line is about) and the event's fields.

Attribution order: the record's `DEVICE=+pci:` dictionary key (the most reliable address,
set by dev_printk), then the address the rule captured (NVRM's `PCI:dddd:bb:dd`), then
every other address in the text (AER lines name the reporting port first and the erring
device second). The first address that names a configured GPU wins; a line with no
address is host-wide (gpu None).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from gpuguard.kernel.kmsg import KmsgRecord
from gpuguard.kernel.rules import Match
from gpuguard.state.events import Event

GpuNameForBdf = Callable[[str], "str | None"]


def attribute(record: KmsgRecord | None, match: Match,
              gpu_name_for_bdf: GpuNameForBdf | None) -> tuple[str | None, str | None]:
    """(gpu name or None, bdf or None) for a classified record."""
    candidates: list[str] = []
    if record is not None and record.device_bdf:
        candidates.append(record.device_bdf)
    for bdf in (match.bdf, *match.bdf_all):
        if bdf and bdf not in candidates:
            candidates.append(bdf)
    if gpu_name_for_bdf is not None:
        for bdf in candidates:
            name = gpu_name_for_bdf(bdf)
            if name:
                return name, bdf
    return None, (candidates[0] if candidates else None)


def wall_time_of(usec: int, now: float | None = None, mono_now: float | None = None) -> float:
    """Wall-clock time of a record stamped `usec` after boot (kmsg stamps use the
    monotonic clock). Falls back to now for stamps that cannot be from this boot."""
    now = time.time() if now is None else now
    mono_now = time.clock_gettime(time.CLOCK_MONOTONIC) if mono_now is None else mono_now
    age = mono_now - usec / 1e6
    return now - age if 0 <= age < mono_now + 1 else now


def to_event(record: KmsgRecord, match: Match, gpu_name_for_bdf: GpuNameForBdf | None) -> Event:
    gpu, bdf = attribute(record, match, gpu_name_for_bdf)
    fields: dict[str, Any] = dict(match.fields)
    fields.update({
        "seq": record.seq,
        "usec": record.usec,
        "level": record.level,
        "facility": record.facility,
        "condition": match.condition,
        "rule": match.rule,
    })
    if match.xid is not None:
        fields["xid"] = match.xid
    if match.bdf_all:
        fields["bdf_all"] = list(match.bdf_all)
    if record.fields.get("SUBSYSTEM"):
        fields["subsystem"] = record.fields["SUBSYSTEM"]
    if record.device_bdf:
        fields["device"] = record.device_bdf
    return Event(
        kind=match.kind, severity=match.severity, source="kernel", message=record.text.strip(),
        gpu=gpu, bdf=bdf, time=wall_time_of(record.usec), fields=fields,
    )


__all__ = ["attribute", "to_event", "wall_time_of", "GpuNameForBdf"]

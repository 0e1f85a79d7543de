"""The daemon's status in two sizes: the whole document (`GET /v1/status`, `gpuguard
status`) and its one-line summary (the same document's `summary`, systemd's STATUS=, the
ready log line). Both format what the hub holds; neither touches hardware."""
from __future__ import annotations

import time
from typing import Any

from gpuguard import __version__
from gpuguard.state.audit import jsonable
from gpuguard.state.hub import Hub


def status_document(hub: Hub) -> dict[str, Any]:
    snap = hub.snapshot
    gpus = [g.to_dict() for g in snap.gpus] if snap else []
    return {
        "version": __version__,
        "time": time.time(),
        "last_poll": dict(hub.last_poll),
        "gpus": gpus,
        "summary": summary_line(hub),
        # per GPU: identity, presence (present/not_answering/lost and by which route),
        # profile state; and the configured cards that are missing
        "gpu_states": [st.to_dict() for st in hub.gpus.all()],
        "missing": [{"gpu": m.name, "match": m.match, "why": m.why} for m in hub.gpus.missing()],
        # per GPU: the profile, whether it read back equal, and the effective-clock
        # findings ("profile applied but card runs at 1233 MHz", INCIDENTS §3)
        "profiles": jsonable(hub.view("profiles") or {}),
        # which processes hold each GPU (pid, comm, engine, VRAM), from the engine
        # watchdog's DRM fdinfo / NVML scan; absent when no watchdog runs (engines: [])
        "gpu_processes": jsonable(hub.view("gpu_processes") or {"scanned_at": None, "processes": []}),
    }


def summary_line(hub: Hub) -> str:
    snap = hub.snapshot
    if snap is None:
        return "starting: no poll yet"
    if hub.gpus.observed:
        # configured vs present, missing cards named (state/gpus.py; INCIDENTS §2)
        line = hub.gpus.summary()
    else:  # a snapshot published without discovery (a test's hand-made hub)
        down = [g.name for g in snap.gpus if not g.up]
        line = f"{sum(1 for g in snap.gpus if g.up)}/{len(snap.gpus)} GPUs up" + (f"; down: {', '.join(down)}" if down else "")
    notes = [n for _, n in sorted(hub.notes.items()) if n]
    return "; ".join([line] + notes)

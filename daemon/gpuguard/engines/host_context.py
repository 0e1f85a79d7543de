"""What the rest of the daemon tells the engine watchdog about the host: the GPU
telemetry now (for pause statistics) and the telemetry and kernel lines of a time window
(for incident bundles), from the hub and the flight recorder. Plain callables, so the
watchdog stays testable without a daemon."""
from __future__ import annotations

from typing import Any, Callable, Sequence


def gpu_now(hub: Any) -> Callable[[Sequence[str]], dict[str, dict]]:
    def now(names: Sequence[str]) -> dict[str, dict]:
        snap = hub.snapshot
        out = {}
        for name in names:
            g = snap.gpu(name) if snap is not None else None
            if g is not None:
                out[name] = {"busy_ratio": g.busy_ratio, "power_watts": g.power_watts}
        return out

    return now


def window(hub: Any, recorder: Any) -> Callable[[list[str], float, float], dict]:
    """(gpu names, since, until) -> {"gpu_samples": [...], "kernel_lines": [...]}. Blocking
    (a recorder query): the incident collector runs it in a thread, with a timeout."""
    def ctx(gpus: list[str], since: float, until: float) -> dict:
        out: dict[str, Any] = {"since": since, "until": until, "gpus": gpus}
        if recorder is not None and gpus:
            marks = ",".join("?" * len(gpus))
            cols = ("t", "gpu", "bdf", "up", "power_w", "cap_w", "edge_c", "junction_c", "mem_c", "sclk_hz",
                    "mclk_hz", "fan_rpm", "busy", "vram_used", "errors")
            rows = recorder.query(f"SELECT {', '.join(cols)} FROM samples WHERE t >= ? AND t <= ? AND gpu IN ({marks})"
                                  " ORDER BY t", (since, until, *gpus))
            out["gpu_samples"] = [dict(zip(cols, r)) for r in rows]
        else:
            out["gpu_samples"] = []
            out["note"] = "no flight recorder, or no GPU known for this engine"
        out["kernel_lines"] = [e.to_dict() for e in hub.recent_events(since)
                               if e.source in ("kernel", "udev") and e.time <= until]
        return out

    return ctx

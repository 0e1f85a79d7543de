"""`EngineSnapshot`: the immutable per-engine view the watchdog produces every poll and
every sink (metrics, API, CLI) reads."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class EngineSnapshot:
    name: str
    kind: str
    state: str  # starting ready idle busy unresponsive stalled unhealthy down
    pid: int | None
    requests_running: float | None
    requests_waiting: float | None
    generated_tokens_total: float | None
    heartbeat: float | None
    tokens_per_second: float | None
    no_progress_seconds: float
    decode_gap_seconds: float | None
    stalled: bool
    cpu_percent: float | None
    last_action: str | None
    time_to_ready_seconds: float | None
    url: str = ""
    gpus: tuple[str, ...] = ()
    gpu_pid: int | None = None
    reason: str | None = None
    health: str | None = None
    metrics_error: str | None = None
    stall_window_seconds: float | None = None
    polled_at: float = 0.0
    polls: int = 0
    error: str | None = None
    pauses: int = 0  # no-progress periods that ended by themselves
    longest_pause_today_seconds: float | None = None
    last_incident: str | None = None  # the newest incident bundle's folder name
    evidence: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "evidence", MappingProxyType(dict(self.evidence)))
        object.__setattr__(self, "gpus", tuple(self.gpus))

    @property
    def up(self) -> bool:
        return self.health == "ready"

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["gpus"] = list(self.gpus)
        d["evidence"] = dict(self.evidence)
        d["up"] = self.up
        return d

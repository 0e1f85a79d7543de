"""Events: what every source reports to the hub and every sink consumes. Immutable."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

SEVERITIES = ("info", "warning", "alert", "critical")


@dataclass(frozen=True)
class Event:
    """One thing that happened. `kind` is a stable machine name (`gpu_hang`, `gpu_lost`,
    `engine_stalled`, `profile_unverified`, ...); `severity` one of SEVERITIES, where
    `alert` and `critical` are alert-grade (webhooks, audit). `gpu` is the configured GPU
    name, `bdf` its PCI address; both None for host-wide events."""

    kind: str
    severity: str
    source: str
    message: str
    gpu: str | None = None
    bdf: str | None = None
    engine: str | None = None
    time: float = field(default_factory=time.time)
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"event severity {self.severity!r} not one of {SEVERITIES}")
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))

    @property
    def alert_grade(self) -> bool:
        return self.severity in ("alert", "critical")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "source": self.source,
            "message": self.message,
            "gpu": self.gpu,
            "bdf": self.bdf,
            "engine": self.engine,
            "time": self.time,
            "fields": dict(self.fields),
        }

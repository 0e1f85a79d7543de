"""Profile writes in the daemon's one audit log (gpuguard.sinks.audit: `<state_dir>/
audit.jsonl`, append-only, fsynced). The apply code speaks in flat records
(`{"action": "write", "who", "why", "gpu", "bdf", "file", "value", ...}`); this adapter
files them as `what` / `target` / `result` with the rest as evidence, and reads them back
flat for tests and `gpuguard apply`. DESIGN.md: anything that writes hardware is logged."""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable

from gpuguard.sinks.audit import AUDIT_FILE
from gpuguard.sinks.audit import AuditLog as _SinkAudit

Audit = Callable[[dict], None]

_TOP = ("action", "who", "why", "gpu", "result")


def audit_path(state_dir: str) -> str:
    return os.path.join(state_dir, AUDIT_FILE)


class AuditLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._log = _SinkAudit(path)
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        evidence = {k: v for k, v in record.items() if k not in _TOP}
        with self._lock:
            self._log.record(
                f"profile_{record.get('action', '?')}",
                str(record.get("who", "?")),
                str(record.get("why", "")),
                target=record.get("gpu"),
                evidence=evidence,
                result=str(record.get("result", "ok")),
            )

    def before(self, gpu: str, profile: str, who: str, why: str) -> None:
        """The record written before a card is touched; raises AuditUnavailable when it
        cannot be written, and then nothing is applied."""
        with self._lock:
            self._log.record("profile_apply", who, why, target=gpu, evidence={"profile": profile},
                             result="started", required=True)


def read_audit(path: str) -> list[dict[str, Any]]:
    """Profile records of the audit log, flat again (other actions are skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not str(rec.get("what", "")).startswith("profile_"):
                    continue
                out.append({
                    **(rec.get("evidence") or {}),
                    "action": rec["what"][len("profile_"):],
                    "who": rec["who"], "why": rec["why"], "gpu": rec.get("target"),
                    "result": rec.get("result"), "time": rec.get("unix_time"),
                })
    except FileNotFoundError:
        pass
    return out

"""The audit log: every hardware write (and every apply's outcome) as one JSON line with
who asked (`cli`, `policy`, an API token name) and why. DESIGN.md: anything that writes
hardware is logged. Default file: `<state_dir>/audit.log`, appended and fsync'd."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger("gpuguard.audit")

Audit = Callable[[dict], None]


class AuditLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        rec = {"time": time.time(), **record}
        line = json.dumps(rec, sort_keys=True, default=str) + "\n"
        with self._lock:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
                try:
                    os.write(fd, line.encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                # The write itself already happened or is about to; losing the audit line
                # must be loud, never silent.
                log.error("audit log %s not writable (%s); record: %s", self.path, e.strerror, line.strip())


def read_audit(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
